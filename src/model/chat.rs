//! Chat templates, recognised by family instead of run by a Jinja engine.
//!
//! A model's `chat_template` is Jinja; gatestream only ever needs one thing from it: a single user
//! message followed by the opened assistant turn. This module identifies the template's family from
//! its text (ChatML, Gemma, Llama-3, Llama-2/Mistral), reads the few literals that vary inside a
//! family (a default system message, spacing, whether content is trimmed), and writes exactly what
//! the Jinja would for that one case. BOS is never written here: `Tokenizer::encode` adds it. An
//! unrecognised template is an error naming the families supported; nothing is guessed.

/// The chat formats gatestream can render, with what the template's text decided for each.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ChatFamily {
    /// `<|im_start|>role\n...<|im_end|>\n` (SmolLM2, Qwen2.5). Some templates write a default system
    /// turn when the conversation has none.
    ChatMl { default_system: Option<String> },
    /// `<start_of_turn>user\n...<end_of_turn>\n<start_of_turn>model\n` (Gemma 1-3); content trimmed.
    Gemma,
    /// `<|start_header_id|>user<|end_header_id|>\n\n...<|eot_id|>`; content trimmed. Llama-3.1 style
    /// templates always write a system turn with the knowledge cutoff and date.
    Llama3 { default_system: Option<String> },
    /// `[INST] ... [/INST]` (Llama-2, Mistral).
    Inst { spaced: bool, trim: bool },
}

impl ChatFamily {
    /// The family of a Jinja chat template, or `None` if it is none of the supported ones.
    pub fn detect(template: &str) -> Option<ChatFamily> {
        if template.contains("<|im_start|>") {
            Some(ChatFamily::ChatMl {
                default_system: chatml_default_system(template),
            })
        } else if template.contains("<start_of_turn>") {
            Some(ChatFamily::Gemma)
        } else if template.contains("<|start_header_id|>") {
            Some(ChatFamily::Llama3 {
                default_system: llama31_system(template),
            })
        } else if template.contains("[INST]") {
            Some(ChatFamily::Inst {
                spaced: template.contains("[INST] "),
                trim: template.contains(".strip()") || template.contains("| trim"),
            })
        } else {
            None
        }
    }

    /// One user message, then the assistant turn opened (`add_generation_prompt`).
    pub fn render_user_turn(&self, user: &str) -> String {
        match self {
            ChatFamily::ChatMl { default_system } => {
                let mut s = String::new();
                if let Some(system) = default_system {
                    s.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
                }
                s.push_str(&format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"));
                s
            }
            ChatFamily::Gemma => format!(
                "<start_of_turn>user\n{}<end_of_turn>\n<start_of_turn>model\n",
                user.trim()
            ),
            ChatFamily::Llama3 { default_system } => {
                let mut s = String::new();
                if let Some(system) = default_system {
                    s.push_str(&format!(
                        "<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
                    ));
                }
                s.push_str(&format!(
                    "<|start_header_id|>user<|end_header_id|>\n\n{}<|eot_id|>\
                     <|start_header_id|>assistant<|end_header_id|>\n\n",
                    user.trim()
                ));
                s
            }
            ChatFamily::Inst { spaced, trim } => {
                let user = if *trim { user.trim() } else { user };
                if *spaced {
                    format!("[INST] {user} [/INST]")
                } else {
                    format!("[INST]{user}[/INST]")
                }
            }
        }
    }
}

/// Renders `user` with `template`, or says why it cannot.
pub fn render_user_turn(template: &str, user: &str) -> Result<String, String> {
    ChatFamily::detect(template)
        .map(|f| f.render_user_turn(user))
        .ok_or_else(|| {
            "chat template not recognised: supported families are ChatML (<|im_start|>), Gemma \
         (<start_of_turn>), Llama-3 (<|start_header_id|>) and Llama-2/Mistral ([INST]); pass the \
         prompt as plain text instead"
                .to_owned()
        })
}

/// The system message a ChatML template writes when the conversation has none: the first Jinja
/// string literal of the form `'<|im_start|>system\n<literal text><|im_end|>`, with `\n` either
/// escaped or a real newline. Literals that
/// splice in a variable (`'<|im_start|>system\n' + messages[0]...`) do not match.
fn chatml_default_system(template: &str) -> Option<String> {
    const OPEN: &str = "<|im_start|>system";
    let mut rest = template;
    while let Some(at) = rest.find(OPEN) {
        let quote = rest[..at].chars().next_back();
        let after = &rest[at + OPEN.len()..];
        // The newline is written either as an escape or, in some templates, literally.
        let Some(after) = after.strip_prefix("\\n").or_else(|| after.strip_prefix('\n')) else {
            rest = after;
            continue;
        };
        if let (Some(q @ ('\'' | '"')), Some(end)) = (quote, after.find("<|im_end|>")) {
            let body = &after[..end];
            if !body.contains(q) && !body.contains("{{") && !body.contains("{%") {
                return Some(unescape_jinja(body));
            }
        }
        rest = after;
    }
    None
}

/// Llama-3.1 templates always open with a system turn: "Cutting Knowledge Date: December 2023\n
/// Today Date: <date_string>\n\n" (date_string defaults to a literal in the template).
fn llama31_system(template: &str) -> Option<String> {
    const CUTOFF: &str = "Cutting Knowledge Date: December 2023";
    if !template.contains(CUTOFF) {
        return None;
    }
    let date = template.find("date_string = \"").and_then(|at| {
        let rest = &template[at + "date_string = \"".len()..];
        rest.find('"').map(|end| rest[..end].to_owned())
    })?;
    Some(format!("{CUTOFF}\nToday Date: {date}\n\n"))
}

/// Jinja (Python) string-literal escapes.
fn unescape_jinja(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('r') => out.push('\r'),
            Some(other) => out.push(other),
            None => out.push('\\'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    // Real templates are tested against the GGUF files in `tokenizer`'s tests; these are the
    // published Gemma-3, Llama-3 and Mistral templates (abridged to the lines that matter).
    const GEMMA3: &str = "{{ bos_token }}\n{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- endif -%}{%- for message in loop_messages -%}{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}{%- else -%}{%- set role = message['role'] -%}{%- endif -%}{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else \"\") }}{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}{%- if add_generation_prompt -%}{{'<start_of_turn>model\n'}}{%- endif -%}";
    const LLAMA3: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";
    const MISTRAL: &str = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}{% else %}{{ message['content'] + eos_token}}{% endif %}{% endfor %}";

    #[test]
    fn gemma_llama3_mistral() {
        assert_eq!(
            render_user_turn(GEMMA3, " Hi \n").unwrap(),
            "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            render_user_turn(LLAMA3, "Hi").unwrap(),
            "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(render_user_turn(MISTRAL, "Hi").unwrap(), "[INST] Hi [/INST]");
    }

    #[test]
    fn chatml_without_default_system() {
        let t = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";
        assert_eq!(
            render_user_turn(t, "Hi").unwrap(),
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn unknown_template_is_an_error() {
        let err = render_user_turn("{{ messages[0]['content'] }}", "Hi").unwrap_err();
        assert!(err.contains("not recognised"), "{err}");
    }
}

//! Chat templates, recognised by family instead of run by a Jinja engine.
//!
//! A model's `chat_template` is Jinja; gatestream needs one thing from it: a conversation (system,
//! user and assistant turns) followed by the opened assistant turn. This module identifies the template's family from
//! its text (ChatML, Gemma, Llama-3, Llama-2/Mistral, DeepSeek, GLM-4, gpt-oss's Harmony), reads the few literals that vary inside a
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
    /// DeepSeek-V3 / R1: the system message right after BOS, `<｜User｜>...`, an answer
    /// `<｜Assistant｜>...<｜end▁of▁sentence｜>`; DeepSeek-V2 (`v3: false`): `User: ...\n\n`,
    /// `Assistant: ...<｜end▁of▁sentence｜>`, the system message and `\n\n` first.
    DeepSeek { v3: bool },
    /// gpt-oss's Harmony format as llama.cpp renders it (`LLM_CHAT_TEMPLATE_OPENAI_MOE`):
    /// `<|start|>role<|message|>...<|end|>` (an assistant turn closed by `<|return|>`), then
    /// `<|start|>assistant`; the model writes its channel (`<|channel|>analysis` or `final`)
    /// itself, and its answer is what follows `<|channel|>final<|message|>` ([`harmony_final`]).
    Harmony,
    /// GLM-4 / GLM-4.5 as llama.cpp renders them (`LLM_CHAT_TEMPLATE_CHATGLM_4`, recognised by
    /// `[gMASK]<sop>`): `[gMASK]<sop>`, then `<|role|>\ncontent` per message, then
    /// `<|assistant|>\n`. (GLM-4.5 may open its answer with a `<think>…</think>` block.)
    Glm4,
}

/// DeepSeek's end of an assistant turn (its EOS).
const DEEPSEEK_EOS: &str = "<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>";

impl ChatFamily {
    /// The family of a Jinja chat template, or `None` if it is none of the supported ones.
    pub fn detect(template: &str) -> Option<ChatFamily> {
        if template.contains("<|start|>") && template.contains("<|channel|>") {
            Some(ChatFamily::Harmony)
        } else if template.contains("<|im_start|>") {
            Some(ChatFamily::ChatMl {
                default_system: chatml_default_system(template),
            })
        } else if template.contains("<start_of_turn>") {
            Some(ChatFamily::Gemma)
        } else if template.contains("[gMASK]<sop>") {
            Some(ChatFamily::Glm4)
        } else if template.contains("<|start_header_id|>") {
            Some(ChatFamily::Llama3 {
                default_system: llama31_system(template),
            })
        } else if template.contains("<\u{ff5c}Assistant\u{ff5c}>") {
            Some(ChatFamily::DeepSeek { v3: true })
        } else if template.contains("'User: '") && template.contains("'Assistant:'") {
            Some(ChatFamily::DeepSeek { v3: false })
        } else if template.contains("[INST]") {
            Some(ChatFamily::Inst {
                spaced: template.contains("[INST] "),
                trim: template.contains(".strip()") || template.contains("| trim"),
            })
        } else {
            None
        }
    }

    /// A conversation (an optional system message first, then user and assistant turns), then
    /// the assistant turn opened, as the family's template writes it. A system message after
    /// the first is written as a system turn where the family has that role (ChatML, Llama-3),
    /// else as a user turn.
    pub fn render(&self, messages: &[(Role, &str)]) -> String {
        let (system, turns) = match messages.split_first() {
            Some(((Role::System, sys), rest)) => (Some(*sys), rest),
            _ => (None, messages),
        };
        let mut s = String::new();
        match self {
            ChatFamily::ChatMl { default_system } => {
                if let Some(system) = system.or(default_system.as_deref()) {
                    s.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
                }
                for (role, content) in turns {
                    s.push_str(&format!("<|im_start|>{}\n{content}<|im_end|>\n", role.name()));
                }
                s.push_str("<|im_start|>assistant\n");
            }
            ChatFamily::Gemma => {
                // The system message opens the first user turn (Gemma has no system role).
                let mut prefix = system.map(|sys| format!("{sys}\n\n"));
                for (role, content) in turns {
                    let role = match role {
                        Role::Assistant => "model",
                        Role::User | Role::System => "user",
                    };
                    let prefix = if role == "user" { prefix.take() } else { None };
                    s.push_str(&format!(
                        "<start_of_turn>{role}\n{}{}<end_of_turn>\n",
                        prefix.unwrap_or_default(),
                        content.trim()
                    ));
                }
                s.push_str("<start_of_turn>model\n");
            }
            ChatFamily::Llama3 { default_system } => {
                let system = match (default_system, system) {
                    (Some(d), sys) => Some(format!("{d}{}", sys.unwrap_or("").trim())),
                    (None, sys) => sys.map(|x| x.trim().to_owned()),
                };
                if let Some(system) = system {
                    s.push_str(&format!(
                        "<|start_header_id|>system<|end_header_id|>\n\n{system}<|eot_id|>"
                    ));
                }
                for (role, content) in turns {
                    s.push_str(&format!(
                        "<|start_header_id|>{}<|end_header_id|>\n\n{}<|eot_id|>",
                        role.name(),
                        content.trim()
                    ));
                }
                s.push_str("<|start_header_id|>assistant<|end_header_id|>\n\n");
            }
            ChatFamily::DeepSeek { v3 } => {
                if let Some(system) = system {
                    s.push_str(system);
                    if !v3 {
                        s.push_str("\n\n");
                    }
                }
                for (role, content) in turns {
                    match (role, v3) {
                        (Role::Assistant, true) => {
                            s.push_str(&format!("<\u{ff5c}Assistant\u{ff5c}>{content}{DEEPSEEK_EOS}"))
                        }
                        (Role::Assistant, false) => s.push_str(&format!("Assistant: {content}{DEEPSEEK_EOS}")),
                        (_, true) => s.push_str(&format!("<\u{ff5c}User\u{ff5c}>{content}")),
                        (_, false) => s.push_str(&format!("User: {content}\n\n")),
                    }
                }
                s.push_str(if *v3 {
                    "<\u{ff5c}Assistant\u{ff5c}>"
                } else {
                    "Assistant:"
                });
            }
            ChatFamily::Harmony => {
                for (role, content) in messages {
                    let close = if *role == Role::Assistant {
                        "<|return|>"
                    } else {
                        "<|end|>"
                    };
                    s.push_str(&format!("<|start|>{}<|message|>{content}{close}", role.name()));
                }
                s.push_str("<|start|>assistant");
            }
            ChatFamily::Glm4 => {
                s.push_str("[gMASK]<sop>");
                for (role, content) in messages {
                    s.push_str(&format!("<|{}|>\n{content}", role.name()));
                }
                s.push_str("<|assistant|>\n");
            }
            ChatFamily::Inst { spaced, trim } => {
                // The system message opens the first user turn; an assistant turn is closed by
                // EOS (`</s>`, as Llama-2 and Mistral spell it).
                let mut prefix = system.map(|sys| format!("{sys}\n\n"));
                for (role, content) in turns {
                    let content = if *trim { content.trim() } else { content };
                    match role {
                        Role::Assistant => s.push_str(&format!("{content}</s>")),
                        Role::User | Role::System => {
                            let user = format!("{}{content}", prefix.take().unwrap_or_default());
                            if *spaced {
                                s.push_str(&format!("[INST] {user} [/INST]"));
                            } else {
                                s.push_str(&format!("[INST]{user}[/INST]"));
                            }
                        }
                    }
                }
            }
        }
        s
    }
}

/// The answer in a Harmony (gpt-oss) reply: what follows its last `<|channel|>final<|message|>`,
/// up to an `<|end|>` or `<|return|>` if one follows; the reply as it is when it has no final
/// channel (a reply cut short in its analysis, or another model's).
pub fn harmony_final(reply: &str) -> &str {
    const FINAL: &str = "<|channel|>final<|message|>";
    match reply.rfind(FINAL) {
        None => reply,
        Some(at) => {
            let answer = &reply[at + FINAL.len()..];
            let end = ["<|end|>", "<|return|>"]
                .iter()
                .filter_map(|t| answer.find(t))
                .min()
                .unwrap_or(answer.len());
            &answer[..end]
        }
    }
}

/// A Harmony (gpt-oss) reply split as it is written ([`HarmonySplit::push`]): the text of
/// its analysis channel (the reasoning) and of its final channel (the answer) in this piece.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct HarmonyPiece {
    pub reasoning: String,
    pub answer: String,
}

/// Splits a Harmony reply, given a piece at a time as it is generated, into its reasoning (the
/// `analysis` channel, and any channel but `final`) and its answer (the `final` channel), leaving
/// out the markers between messages (`<|channel|>NAME<|message|>`, `<|end|>`,
/// `<|start|>assistant`, `<|return|>`, `<|call|>`). Text that may be the start of a marker is
/// held back until the next piece decides it. Over a whole reply the answer is
/// [`harmony_final`]'s when the reply has one final message.
#[derive(Debug, Default)]
pub struct HarmonySplit {
    held: String,
    /// In a message's body: whether it is the final channel's. `None`: in a header, before
    /// `<|message|>`.
    body: Option<bool>,
}

/// The markers that end a Harmony message's body.
const HARMONY_ENDS: [&str; 5] = ["<|end|>", "<|return|>", "<|call|>", "<|start|>", "<|channel|>"];

impl HarmonySplit {
    pub fn new() -> HarmonySplit {
        HarmonySplit::default()
    }

    pub fn push(&mut self, text: &str) -> HarmonyPiece {
        self.held.push_str(text);
        let mut out = HarmonyPiece::default();
        loop {
            match self.body {
                None => {
                    const MESSAGE: &str = "<|message|>";
                    let Some(at) = self.held.find(MESSAGE) else { break };
                    let header = &self.held[..at];
                    let channel = header
                        .rfind("<|channel|>")
                        .map(|c| &header[c + "<|channel|>".len()..])
                        .unwrap_or("");
                    self.body = Some(channel.trim_start().starts_with("final"));
                    self.held.drain(..at + MESSAGE.len());
                }
                Some(is_final) => {
                    let end = HARMONY_ENDS
                        .iter()
                        .filter_map(|m| self.held.find(m).map(|at| (at, *m)))
                        .min();
                    let keep_from = match end {
                        Some((at, _)) => at,
                        // Hold back a tail that may be a marker's beginning.
                        None => self
                            .held
                            .rfind('<')
                            .filter(|&lt| HARMONY_ENDS.iter().any(|m| m.starts_with(&self.held[lt..])))
                            .unwrap_or(self.held.len()),
                    };
                    let dest = if is_final { &mut out.answer } else { &mut out.reasoning };
                    dest.push_str(&self.held[..keep_from]);
                    self.held.drain(..keep_from);
                    match end {
                        Some((_, m)) => {
                            // A message's end marker goes; `<|start|>` and `<|channel|>` open
                            // the next header.
                            if matches!(m, "<|end|>" | "<|return|>" | "<|call|>") {
                                self.held.drain(..m.len());
                            }
                            self.body = None;
                        }
                        None => break,
                    }
                }
            }
        }
        out
    }

    /// The end of the reply: what was held back, given to the message it was in (a reply with
    /// no Harmony message at all is given whole, as its answer).
    pub fn finish(&mut self) -> HarmonyPiece {
        let held = std::mem::take(&mut self.held);
        match self.body {
            Some(false) => HarmonyPiece {
                reasoning: held,
                answer: String::new(),
            },
            Some(true) => HarmonyPiece {
                reasoning: String::new(),
                answer: held,
            },
            None if held.contains("<|") => HarmonyPiece::default(),
            None => HarmonyPiece {
                reasoning: String::new(),
                answer: held,
            },
        }
    }
}

/// Who wrote a chat message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    /// The role's name in chat APIs and in ChatML / Llama-3 headers.
    pub fn name(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }

    pub fn from_name(name: &str) -> Option<Role> {
        match name {
            "system" | "developer" => Some(Role::System),
            "user" => Some(Role::User),
            "assistant" => Some(Role::Assistant),
            _ => None,
        }
    }
}

/// Renders `user` with `template`, or says why it cannot.
pub fn render_user_turn(template: &str, user: &str) -> Result<String, String> {
    render(template, &[(Role::User, user)])
}

/// Renders a conversation with `template` (see [`ChatFamily::render`]), or says why it cannot.
pub fn render(template: &str, messages: &[(Role, &str)]) -> Result<String, String> {
    ChatFamily::detect(template).map(|f| f.render(messages)).ok_or_else(|| {
        "chat template not recognised: supported families are ChatML (<|im_start|>), Gemma \
         (<start_of_turn>), Llama-3 (<|start_header_id|>), Llama-2/Mistral ([INST]), DeepSeek-V2/V3 \
         (User: / <\u{ff5c}User\u{ff5c}>), GLM-4/4.5 ([gMASK]<sop>) and gpt-oss's Harmony (<|start|> … \
         <|channel|>); pass the prompt as plain text instead"
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
    fn conversations_with_system_and_assistant_turns() {
        let conv = [
            (Role::System, "Be brief."),
            (Role::User, "Hi"),
            (Role::Assistant, "Hello."),
            (Role::User, "Bye"),
        ];
        assert_eq!(
            render(GEMMA3, &conv).unwrap(),
            "<start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n\
             <start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
        );
        assert_eq!(
            render(LLAMA3, &conv).unwrap(),
            "<|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nHello.<|eot_id|>\
             <|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\n"
        );
        assert_eq!(
            render(MISTRAL, &conv).unwrap(),
            "[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Bye [/INST]"
        );
        let chatml = ChatFamily::ChatMl {
            default_system: Some("You are helpful.".into()),
        };
        assert_eq!(
            chatml.render(&conv),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
        );
        // Without a system message, the template's default one.
        assert!(chatml
            .render(&conv[1..])
            .starts_with("<|im_start|>system\nYou are helpful.<|im_end|>"));
    }

    /// DeepSeek-V3's template (its tool branches left out) and DeepSeek-V2-Lite-Chat's, as
    /// their tokenizer_config.json files write them.
    #[test]
    fn deepseek_templates() {
        let v3 = "{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}{%- if message['role'] == 'user' %}\
                  {{'<\u{ff5c}User\u{ff5c}>' + message['content']}}{%- endif %}{%- if message['role'] == 'assistant' %}\
                  {{'<\u{ff5c}Assistant\u{ff5c}>' + message['content'] + '<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>'}}\
                  {%- endif %}{%- endfor %}{% if add_generation_prompt %}{{'<\u{ff5c}Assistant\u{ff5c}>'}}{% endif %}";
        let v2 = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + \
                  message['content'] + '\n\n' }}{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + \
                  message['content'] + eos_token }}{% elif message['role'] == 'system' %}{{ message['content'] + \
                  '\n\n' }}{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}";
        let conv = [
            (Role::System, "Be brief."),
            (Role::User, "Hi"),
            (Role::Assistant, "Hello."),
            (Role::User, "Bye"),
        ];
        assert_eq!(
            render(v3, &conv).unwrap(),
            "Be brief.<\u{ff5c}User\u{ff5c}>Hi<\u{ff5c}Assistant\u{ff5c}>Hello.<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>\
             <\u{ff5c}User\u{ff5c}>Bye<\u{ff5c}Assistant\u{ff5c}>"
        );
        assert_eq!(
            render(v2, &conv).unwrap(),
            "Be brief.\n\nUser: Hi\n\nAssistant: Hello.<\u{ff5c}end\u{2581}of\u{2581}sentence\u{ff5c}>User: Bye\n\nAssistant:"
        );
    }

    /// gpt-oss: the Harmony turns as llama.cpp's `OPENAI_MOE` template writes them (the
    /// published template, abridged to the markers its detection reads), and the answer taken
    /// from the final channel of a reply.
    #[test]
    fn harmony_renders_as_llama_cpp_and_the_final_channel_is_the_answer() {
        let t = "{#- gpt-oss -#}{{- '<|start|>system<|message|>' }}{%- for message in loop_messages -%}                 {{- '<|start|>' + message.role + '<|channel|>final<|message|>' + message.content + '<|end|>' }}                 {%- endfor -%}{%- if add_generation_prompt -%}<|start|>assistant{%- endif -%}";
        assert_eq!(ChatFamily::detect(t), Some(ChatFamily::Harmony));
        assert_eq!(
            render_user_turn(t, "Hi").unwrap(),
            "<|start|>user<|message|>Hi<|end|><|start|>assistant"
        );
        let conv = [
            (Role::System, "Be brief."),
            (Role::User, "Hi"),
            (Role::Assistant, "Hello."),
            (Role::User, "Bye"),
        ];
        assert_eq!(
            render(t, &conv).unwrap(),
            "<|start|>system<|message|>Be brief.<|end|><|start|>user<|message|>Hi<|end|>\
             <|start|>assistant<|message|>Hello.<|return|><|start|>user<|message|>Bye<|end|><|start|>assistant"
        );
        let reply = "<|channel|>analysis<|message|>The user says hi.<|end|><|start|>assistant\
                     <|channel|>final<|message|>Hello!<|return|>";
        assert_eq!(harmony_final(reply), "Hello!");
        assert_eq!(harmony_final("<|channel|>final<|message|>Hi there"), "Hi there");
        assert_eq!(harmony_final("plain text"), "plain text");
    }

    /// A Harmony reply given a few characters at a time, markers split across pieces: the
    /// reasoning and the answer come out apart, without markers, and the answer is
    /// `harmony_final`'s; a reply without Harmony markers is its own answer.
    #[test]
    fn harmony_replies_split_into_reasoning_and_answer_as_they_are_written() {
        let reply = "<|channel|>analysis<|message|>The user says hi. 2<3.<|end|><|start|>assistant\
                     <|channel|>final<|message|>Hello <b>there</b>!<|return|>";
        for step in [1, 2, 3, 5, 7, 64] {
            let mut split = HarmonySplit::new();
            let (mut reasoning, mut answer) = (String::new(), String::new());
            let chars: Vec<char> = reply.chars().collect();
            for piece in chars.chunks(step) {
                let p = split.push(&piece.iter().collect::<String>());
                reasoning.push_str(&p.reasoning);
                answer.push_str(&p.answer);
            }
            let p = split.finish();
            reasoning.push_str(&p.reasoning);
            answer.push_str(&p.answer);
            assert_eq!(reasoning, "The user says hi. 2<3.", "pieces of {step}");
            assert_eq!(answer, "Hello <b>there</b>!", "pieces of {step}");
            assert_eq!(answer, harmony_final(reply));
        }
        // Cut short in the analysis: what was written is reasoning; no answer.
        let mut split = HarmonySplit::new();
        let p = split.push("<|channel|>analysis<|message|>Thinking <|");
        assert_eq!((p.reasoning.as_str(), p.answer.as_str()), ("Thinking ", ""));
        assert_eq!(split.finish().reasoning, "<|");
        let mut plain = HarmonySplit::new();
        assert_eq!(plain.push("no markers").answer, "");
        assert_eq!(plain.finish().answer, "no markers");
    }

    /// GLM-4 / GLM-4.5: llama.cpp's `CHATGLM_4` rendering, recognised by `[gMASK]<sop>`.
    #[test]
    fn glm4_renders_as_llama_cpp() {
        let t = "[gMASK]<sop>{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}{%- endfor %}\
                 {%- if add_generation_prompt %}<|assistant|>\n{% endif %}";
        assert_eq!(ChatFamily::detect(t), Some(ChatFamily::Glm4));
        let conv = [
            (Role::System, "Be brief."),
            (Role::User, "Hi"),
            (Role::Assistant, "Hello."),
            (Role::User, "Bye"),
        ];
        assert_eq!(
            render(t, &conv).unwrap(),
            "[gMASK]<sop><|system|>\nBe brief.<|user|>\nHi<|assistant|>\nHello.<|user|>\nBye<|assistant|>\n"
        );
    }

    #[test]
    fn unknown_template_is_an_error() {
        let err = render_user_turn("{{ messages[0]['content'] }}", "Hi").unwrap_err();
        assert!(err.contains("not recognised"), "{err}");
    }
}

//! The HTTP API's request bodies (OpenAI's shapes, llama-server's for tokenize/detokenize, the
//! seeds' `/v1/infer`), checked into engine requests before any work, and the error shape every
//! endpoint answers with. Response bodies are written where they are sent (`http`).

use serde::Deserialize;

use crate::engine::Request;
use crate::model::chat::Role;
use crate::model::generate::Finish;
use crate::model::sampler::SamplerConfig;

/// An error as OpenAI's API writes it: `{"error": {"message", "type", "code"}}` with an HTTP status.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiError {
    pub status: u16,
    pub message: String,
    /// `invalid_request_error`, `not_found_error`, `server_error`, `unavailable_error`.
    pub kind: &'static str,
    pub code: Option<&'static str>,
}

impl From<crate::Error> for ApiError {
    fn from(e: crate::Error) -> ApiError {
        ApiError::of(&e, "")
    }
}

impl ApiError {
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 400,
            message: message.into(),
            kind: "invalid_request_error",
            code: None,
        }
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 503,
            message: message.into(),
            kind: "unavailable_error",
            code: None,
        }
    }

    pub fn server(message: impl Into<String>) -> ApiError {
        ApiError {
            status: 500,
            message: message.into(),
            kind: "server_error",
            code: None,
        }
    }

    /// A library error as the API answers it, `what` (if any) before its message: 400 where the
    /// request is at fault ([`Error::Input`](crate::Error::Input), and the model's tokenizer or
    /// chat template refusing it), 500 where the device or gatestream itself is
    /// ([`Error::Device`](crate::Error::Device), [`Error::Internal`](crate::Error::Internal), a
    /// read that failed), 503 for cancelled work.
    pub fn of(e: &crate::Error, what: &str) -> ApiError {
        use crate::Error as E;
        let message = match what {
            "" => e.to_string(),
            _ => format!("{what}: {e}"),
        };
        match e {
            E::Device(_) | E::Internal(_) | E::Io { .. } | E::Read { .. } => ApiError::server(message),
            E::Cancelled => ApiError::unavailable(message),
            _ => ApiError::invalid(message),
        }
    }

    pub fn with_code(mut self, code: &'static str) -> ApiError {
        self.code = Some(code);
        self
    }

    pub fn body(&self) -> serde_json::Value {
        serde_json::json!({"error": {"message": self.message, "type": self.kind, "code": self.code}})
    }
}

/// A string or a list of them (`prompt`, `stop`).
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

/// A completion prompt: text, one text in a list, or token ids.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Prompt {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
}

/// What both completion endpoints take for sampling and stopping.
#[derive(Deserialize, Debug, Clone, Default)]
#[serde(default)]
pub struct Sampling {
    pub max_tokens: Option<u64>,
    pub max_completion_tokens: Option<u64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    /// Not OpenAI's; llama-server's (0 = every token).
    pub top_k: Option<usize>,
    pub seed: Option<i64>,
    pub stop: Option<OneOrMany>,
    pub n: Option<u32>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    /// Refused when given (not silently ignored).
    pub logit_bias: Option<serde_json::Value>,
    pub tools: Option<serde_json::Value>,
    /// The server runs dense or sparse; `mode` picks one per request (not OpenAI's).
    pub mode: Option<String>,
    /// Not OpenAI's; llama-server's: never end at the model's stop tokens (generate to
    /// `max_tokens`, for timing).
    pub ignore_eos: Option<bool>,
}

#[derive(Deserialize, Debug, Clone, Default)]
#[serde(default)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

impl Sampling {
    pub fn stream(&self) -> bool {
        self.stream.unwrap_or(false)
    }

    /// A final chunk with the usage, before `[DONE]` (streaming only).
    pub fn include_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false)
    }
}

#[derive(Deserialize, Debug, Clone)]
pub struct CompletionBody {
    pub model: Option<String>,
    pub prompt: Prompt,
    /// The number of most likely tokens to report per position (completions' `logprobs`).
    #[serde(default)]
    pub logprobs: Option<u32>,
    #[serde(default)]
    pub echo: bool,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Deserialize, Debug, Clone)]
pub struct ChatBody {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    #[serde(default)]
    pub logprobs: Option<bool>,
    #[serde(default)]
    pub top_logprobs: Option<u32>,
    #[serde(flatten)]
    pub sampling: Sampling,
}

#[derive(Deserialize, Debug, Clone)]
pub struct Message {
    pub role: String,
    /// `null` (an assistant turn that only called tools) counts as empty.
    #[serde(default)]
    pub content: Option<Content>,
}

/// A message's content: text, or parts of which only text is understood.
#[derive(Deserialize, Debug, Clone)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize, Debug, Clone)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    #[serde(default)]
    pub text: Option<String>,
}

#[derive(Deserialize, Debug, Clone)]
pub struct InferBody {
    pub prompt: String,
    /// How many of the most likely next tokens to report.
    #[serde(default = "default_top")]
    pub top: u32,
    /// dense, sparse or compare (both, side by side); default: the server's mode.
    #[serde(default)]
    pub mode: Option<String>,
    /// How many tokens each continuation generates (greedy).
    #[serde(default = "default_infer_tokens")]
    pub max_tokens: u64,
    /// Wrap the prompt in the model's chat template.
    #[serde(default)]
    pub chat: bool,
}

fn default_top() -> u32 {
    5
}

fn default_infer_tokens() -> u64 {
    16
}

#[derive(Deserialize, Debug, Clone)]
pub struct TokenizeBody {
    pub content: String,
    /// Put BOS first where the model adds one.
    #[serde(default = "yes")]
    pub add_special: bool,
}

fn yes() -> bool {
    true
}

#[derive(Deserialize, Debug, Clone)]
pub struct DetokenizeBody {
    pub tokens: Vec<u32>,
}

/// The most stop strings a request may give (OpenAI's limit).
pub const STOP_STRINGS_MAX: usize = 4;
/// The most log-probabilities per position a request may ask for (OpenAI's limit).
pub const TOP_LOGPROBS_MAX: u32 = 20;

/// Parses a JSON body into `T`, an error naming what is wrong otherwise.
pub fn parse<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::invalid(format!("the request body is not valid: {e}")))
}

/// Which engine runs a request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Dense,
    Sparse,
}

impl Mode {
    pub fn name(self) -> &'static str {
        match self {
            Mode::Dense => "dense",
            Mode::Sparse => "sparse",
        }
    }
}

/// `mode` as a request names it (None: the server's).
pub fn mode_of(name: Option<&str>, default: Mode) -> Result<Mode, ApiError> {
    match name {
        None => Ok(default),
        Some("dense") => Ok(Mode::Dense),
        Some("sparse") => Ok(Mode::Sparse),
        Some(other) => Err(ApiError::invalid(format!("mode `{other}` is not one of dense, sparse"))),
    }
}

/// The engine request for `sampling` over `prompt_ids` (the prompt's checks against the context
/// are the engine's; the caller makes them before queueing). `default_max`: tokens to generate
/// when the body names no limit; `any_seed`: the seed when the body gives none.
pub fn request(
    s: &Sampling,
    prompt_ids: Vec<u32>,
    default_max: usize,
    logprobs: bool,
    top_logprobs: u32,
    any_seed: u64,
) -> Result<Request, ApiError> {
    if s.n.is_some_and(|n| n != 1) {
        return Err(ApiError::invalid("only n = 1 is supported (one choice per request)"));
    }
    for (name, v) in [("logit_bias", &s.logit_bias), ("tools", &s.tools)] {
        let given = match v {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Object(o)) => !o.is_empty(),
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(_) => true,
        };
        if given {
            return Err(ApiError::invalid(format!("{name} is not supported")));
        }
    }
    for (name, v) in [
        ("presence_penalty", s.presence_penalty),
        ("frequency_penalty", s.frequency_penalty),
    ] {
        if v.is_some_and(|v| v != 0.0) {
            return Err(ApiError::invalid(format!("{name} is not supported (only 0)")));
        }
    }
    let temperature = s.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(ApiError::invalid(format!(
            "temperature {temperature} must be between 0 and 2"
        )));
    }
    let top_p = s.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(ApiError::invalid(format!("top_p {top_p} must be in (0, 1]")));
    }
    if top_logprobs > TOP_LOGPROBS_MAX {
        return Err(ApiError::invalid(format!(
            "top_logprobs {top_logprobs} is more than {TOP_LOGPROBS_MAX}"
        )));
    }
    let stop = match &s.stop {
        None => Vec::new(),
        Some(OneOrMany::One(x)) => vec![x.clone()],
        Some(OneOrMany::Many(v)) => v.clone(),
    };
    if stop.len() > STOP_STRINGS_MAX {
        return Err(ApiError::invalid(format!(
            "{} stop strings given; at most {STOP_STRINGS_MAX}",
            stop.len()
        )));
    }
    let max_tokens = match s.max_completion_tokens.or(s.max_tokens) {
        Some(0) => return Err(ApiError::invalid("max_tokens must be at least 1")),
        Some(n) => usize::try_from(n).unwrap_or(usize::MAX),
        None => default_max,
    };
    Ok(Request {
        prompt_ids,
        max_tokens,
        sampler: SamplerConfig {
            temperature,
            top_k: s.top_k.unwrap_or(0),
            top_p,
            // No seed, or -1 (llama-server's "any"): a fresh one, so two such requests differ.
            seed: match s.seed {
                None | Some(-1) => any_seed,
                Some(x) => x as u64,
            },
        },
        logprobs: logprobs || top_logprobs > 0,
        top_logprobs: top_logprobs as usize,
        stop,
        lookup: 0,
        ignore_eos: s.ignore_eos.unwrap_or(false),
        logits_on_host: false,
    })
}

/// A chat body's messages as the chat template takes them.
pub fn messages(body: &ChatBody) -> Result<Vec<(Role, String)>, ApiError> {
    if body.messages.is_empty() {
        return Err(ApiError::invalid("messages is empty"));
    }
    body.messages
        .iter()
        .enumerate()
        .map(|(i, m)| {
            let role = Role::from_name(&m.role).ok_or_else(|| {
                ApiError::invalid(format!(
                    "messages[{i}].role `{}` is not one of system, developer, user, assistant",
                    m.role
                ))
            })?;
            let text = match &m.content {
                None => String::new(),
                Some(Content::Text(t)) => t.clone(),
                Some(Content::Parts(parts)) => {
                    let mut t = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(x)) => t.push_str(x),
                            (kind, _) => {
                                return Err(ApiError::invalid(format!(
                                    "messages[{i}] has a `{kind}` part; only text parts are supported"
                                )))
                            }
                        }
                    }
                    t
                }
            };
            Ok((role, text))
        })
        .collect()
}

/// OpenAI's `finish_reason` for how a request ended.
pub fn finish_reason(f: Finish) -> &'static str {
    match f {
        Finish::MaxTokens | Finish::ContextFull => "length",
        Finish::StopToken | Finish::StopString | Finish::Cancelled => "stop",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sampling(json: &str) -> Sampling {
        parse(json.as_bytes()).unwrap()
    }

    #[test]
    fn requests_take_openai_defaults_and_refuse_what_is_not_supported() {
        let r = request(&sampling("{}"), vec![1], 7, false, 0, 9).unwrap();
        assert_eq!(
            (r.max_tokens, r.sampler.temperature, r.sampler.top_p, r.sampler.top_k),
            (7, 1.0, 1.0, 0)
        );
        let r = request(
            &sampling(r#"{"max_tokens": 3, "max_completion_tokens": 5, "temperature": 0, "stop": "\n", "seed": -1}"#),
            vec![1],
            7,
            false,
            2,
            9,
        )
        .unwrap();
        assert_eq!(
            (r.max_tokens, r.sampler.temperature, r.stop.clone(), r.top_logprobs),
            (5, 0.0, vec!["\n".to_string()], 2)
        );
        assert!(r.logprobs);
        for bad in [
            r#"{"n": 2}"#,
            r#"{"temperature": 3}"#,
            r#"{"top_p": 0}"#,
            r#"{"max_tokens": 0}"#,
            r#"{"stop": ["a","b","c","d","e"]}"#,
            r#"{"presence_penalty": 0.5}"#,
        ] {
            assert_eq!(
                request(&sampling(bad), vec![1], 7, false, 0, 9).unwrap_err().status,
                400,
                "{bad}"
            );
        }
        assert!(request(&sampling("{}"), vec![1], 7, false, 21, 9).is_err());
        assert!(parse::<Sampling>(br#"{"temperature": "hot"}"#)
            .unwrap_err()
            .message
            .contains("invalid type"));
    }

    #[test]
    fn chat_messages_take_text_and_text_parts() {
        let body: ChatBody = parse(
            br#"{"messages": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]}]}"#,
        )
        .unwrap();
        assert_eq!(
            messages(&body).unwrap(),
            vec![
                (Role::System, "Be brief.".to_string()),
                (Role::User, "Hi there".to_string())
            ]
        );
        let body: ChatBody = parse(br#"{"messages": [{"role": "assistant", "content": null}]}"#).unwrap();
        assert_eq!(messages(&body).unwrap(), vec![(Role::Assistant, String::new())]);
        let body: ChatBody = parse(br#"{"messages": [{"role": "tool", "content": "x"}]}"#).unwrap();
        assert!(messages(&body).unwrap_err().message.contains("role `tool`"));
        let body: ChatBody =
            parse(br#"{"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}"#).unwrap();
        assert!(messages(&body).unwrap_err().message.contains("image_url"));
        let body: ChatBody = parse(br#"{"messages": []}"#).unwrap();
        assert!(messages(&body).is_err());
    }

    /// The request's fault is a 400, the device's or gatestream's a 500.
    #[test]
    fn library_errors_take_the_status_of_whose_fault_they_are() {
        use crate::Error;
        let status = |e: Error| ApiError::from(e).status;
        assert_eq!(status(Error::Input("prompt too long".into())), 400);
        assert_eq!(
            status(Error::Tokenizer {
                path: "m.gguf".into(),
                what: "the model has no chat template".into()
            }),
            400
        );
        assert_eq!(status(Error::Device("CUDA: out of memory".into())), 500);
        assert_eq!(status(Error::Internal("a broken invariant".into())), 500);
        let e = ApiError::of(&Error::Input("too long".into()), "generation failed");
        assert_eq!(
            (e.status, e.kind, e.message.as_str()),
            (400, "invalid_request_error", "generation failed: too long")
        );
    }
}

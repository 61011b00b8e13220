//! What the sidecar needs to know about a model request: the model, whether it
//! streams, whether it carries tools, images, audio or documents, and a token
//! estimate — read once from the agent's JSON without re-encoding it unless the
//! model must change.

use bytes::Bytes;
use serde_json::Value;

use outrigger_types::Modalities;

use crate::error::Error;
use crate::options::Dialect;

#[derive(Debug, Clone)]
pub struct ModelRequest {
    pub dialect: Dialect,
    pub model: String,
    pub stream: bool,
    pub has_tools: bool,
    pub modalities: Modalities,
    /// A rough prompt-size estimate (bytes / 4), for budgets and context checks.
    pub estimated_prompt_tokens: u64,
    /// `max_tokens` / `max_completion_tokens` if given.
    pub max_output_tokens: Option<u64>,
    pub body: Bytes,
}

impl ModelRequest {
    pub fn parse(dialect: Dialect, body: Bytes) -> Result<Self, Error> {
        let v: Value =
            serde_json::from_slice(&body).map_err(|e| Error::MalformedJson(e.to_string()))?;
        if !v.is_object() {
            return Err(Error::InvalidRequest(
                "The request body must be a JSON object.".into(),
            ));
        }
        let model = v["model"]
            .as_str()
            .filter(|m| !m.is_empty())
            .ok_or_else(|| {
                Error::InvalidRequest(
                    "The request has no \"model\"; name the model to call.".into(),
                )
            })?
            .to_string();
        let stream = v["stream"].as_bool().unwrap_or(false);
        let has_tools = v["tools"].as_array().is_some_and(|t| !t.is_empty());
        // Text always; other modalities from the content parts' types (OpenAI's and
        // Anthropic's names).
        let mut modalities = Modalities::TEXT;
        let parts = v["messages"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|m| m["content"].as_array().into_iter().flatten());
        for part in parts {
            modalities |= match part["type"].as_str() {
                Some("image_url" | "image" | "input_image") => Modalities::IMAGE,
                Some("input_audio" | "audio") => Modalities::AUDIO,
                Some("file" | "input_file" | "document") => Modalities::DOCUMENT,
                _ => Modalities::EMPTY,
            };
        }
        let max_output_tokens = v["max_completion_tokens"]
            .as_u64()
            .or_else(|| v["max_tokens"].as_u64());
        Ok(Self {
            dialect,
            model,
            stream,
            has_tools,
            modalities,
            estimated_prompt_tokens: (body.len() as u64 / 4).max(1),
            max_output_tokens,
            body,
        })
    }

    /// The body with `model` replaced (a downgrade or a fallback to another model).
    pub fn with_model(&self, model: &str) -> Bytes {
        if model == self.model {
            return self.body.clone();
        }
        match serde_json::from_slice::<Value>(&self.body) {
            Ok(mut v) => {
                v["model"] = Value::String(model.to_string());
                Bytes::from(v.to_string())
            }
            Err(_) => self.body.clone(),
        }
    }

    /// Output tokens to reserve: `max_tokens` when given, else a default.
    pub fn reserve_output_tokens(&self) -> u64 {
        self.max_output_tokens.unwrap_or(1_024)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_what_routing_needs() {
        let body = Bytes::from(
            r#"{"model":"gpt-4o","stream":true,"max_tokens":50,"tools":[{"type":"function"}],
               "messages":[{"role":"user","content":[{"type":"text","text":"hi"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
        );
        let r = ModelRequest::parse(Dialect::OpenAi, body).unwrap();
        assert_eq!(r.model, "gpt-4o");
        assert!(r.stream && r.has_tools);
        assert_eq!(r.modalities, Modalities::TEXT | Modalities::IMAGE);
        assert_eq!(r.max_output_tokens, Some(50));
        let swapped: Value = serde_json::from_slice(&r.with_model("gpt-4o-mini")).unwrap();
        assert_eq!(swapped["model"], "gpt-4o-mini");
        assert_eq!(swapped["max_tokens"], 50);
        let pdf = Bytes::from(
            r#"{"model":"claude","messages":[{"role":"user","content":[{"type":"document","source":{}},{"type":"text","text":"sum up"}]}]}"#,
        );
        let pdf_request = ModelRequest::parse(Dialect::Anthropic, pdf).unwrap();
        assert_eq!(
            pdf_request.modalities,
            Modalities::TEXT | Modalities::DOCUMENT
        );
    }

    #[test]
    fn refuses_what_it_cannot_route() {
        assert!(matches!(
            ModelRequest::parse(Dialect::OpenAi, Bytes::from("[1]")),
            Err(Error::InvalidRequest(_))
        ));
        assert!(matches!(
            ModelRequest::parse(Dialect::OpenAi, Bytes::from("{\"model\":\"\"}")),
            Err(Error::InvalidRequest(_))
        ));
        assert!(matches!(
            ModelRequest::parse(Dialect::OpenAi, Bytes::from("{")),
            Err(Error::MalformedJson(_))
        ));
    }
}

//! Step 1b: whose budget a request spends within its group, and its flow there
//! (docs/keys.md): the group of its key, in a `[[limit]]` with `key`; its flow, in a
//! group with `fair_by`. Both are read from the request as it will be sent (the body
//! has been read, for `model`), the proxy user and the client's address.

use std::borrow::Cow;
use std::net::IpAddr;
use std::sync::Arc;

use crate::config::KeySource;
use crate::error::ProxyError;
use crate::limit::fair::Flow;
use crate::limit::keys::id_of;
use crate::limit::Group;
use crate::replay::Replayable;

/// Who sent a request: what `key = "user"` and `"client"` read.
#[derive(Clone, Copy)]
pub(super) struct Asker<'a> {
    pub(super) user: Option<&'a str>,
    pub(super) client: IpAddr,
}

/// The group whose budget `request` spends (its key's, or `group` itself when the
/// group has no `key` or the request has no value for it) and its flow. Refused when
/// its key would be one more than `max_keys`.
pub(super) fn budget(
    group: &Arc<Group>,
    request: &Replayable,
    asker: Asker<'_>,
) -> Result<(Arc<Group>, Option<Flow>), ProxyError> {
    let settings = group.settings();
    let keys = &settings.keys;
    let keyed = match keys.key.as_ref().and_then(|key| value(key, request, asker)) {
        Some(value) => group
            .keyed(id_of(&value))
            .map_err(|refusal| ProxyError::refused(group, refusal))?,
        None => group.clone(),
    };
    let flow = keys.fair_by.as_ref().map(|fair_by| {
        let value = value(fair_by, request, asker).unwrap_or_default();
        let weight = std::str::from_utf8(&value).map_or(1, |v| keys.weight(v));
        Flow {
            id: id_of(&value),
            weight,
        }
    });
    Ok((keyed, flow))
}

/// The value `source` reads from a request, if it has one.
fn value<'a>(
    source: &KeySource,
    request: &'a Replayable,
    asker: Asker<'a>,
) -> Option<Cow<'a, [u8]>> {
    match source {
        KeySource::Header(name) => {
            let (_, headers, _) = request.peek()?;
            Some(Cow::Borrowed(headers.get(name)?.as_bytes()))
        }
        KeySource::User => asker.user.map(|user| Cow::Borrowed(user.as_bytes())),
        KeySource::Client => Some(Cow::Owned(asker.client.to_string().into_bytes())),
        KeySource::Model => {
            let (_, _, body) = request.peek()?;
            model(body?).map(|m| Cow::Owned(m.into_bytes()))
        }
    }
}

/// The `model` of a JSON request body, as LLM APIs name it.
pub(super) fn model(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Named {
        model: Option<String>,
    }
    serde_json::from_slice::<Named>(body).ok()?.model
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_is_read_from_a_json_body() {
        let cases: [(&[u8], Option<&str>); 5] = [
            (br#"{"model":"gpt-4o","messages":[]}"#, Some("gpt-4o")),
            (
                br#"{"messages":[],"model":"claude-3-5-haiku"}"#,
                Some("claude-3-5-haiku"),
            ),
            (br#"{"messages":[]}"#, None),
            (br#"{"model":7}"#, None),
            (b"not json", None),
        ];
        for (body, want) in cases {
            assert_eq!(
                model(body).as_deref(),
                want,
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }
}

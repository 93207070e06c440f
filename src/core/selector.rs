//! Worker selectors: which workers may run an action's jobs, by the
//! workers' tags (labels), in the syntax of Kubernetes label selectors.
//!
//! A selector is a comma-separated list of requirements, all of which
//! must hold (an empty selector matches every worker):
//!
//! | requirement | holds when the worker |
//! |---|---|
//! | `key=value`, `key==value` | has tag `key` with exactly `value` |
//! | `key!=value` | has no tag `key`, or one with another value |
//! | `key in (v1, v2)` | has tag `key` with one of the values |
//! | `key notin (v1, v2)` | has no tag `key`, or one with none of the values |
//! | `key` | has tag `key` (any value) |
//! | `!key` | has no tag `key` |
//!
//! Keys and values are printable ASCII without spaces, `,`, `=`, `!`,
//! `(` or `)`; a value may be empty (`key=`). Spaces around tokens are
//! ignored. Matching is exact and case-sensitive.

use std::{collections::HashMap, fmt};

use crate::error::{Error, Result};

/// Longest selector accepted, in bytes: as written, and in canonical form
/// (its `Display`, which the engines store; see
/// [`crate::core::validate::worker_selector`]).
pub const MAX_SELECTOR_BYTES: usize = 1024;
/// Most requirements in one selector.
pub const MAX_REQUIREMENTS: usize = 32;
/// Most values in one `in`/`notin` set.
pub const MAX_SET_VALUES: usize = 64;

/// One requirement of a [`Selector`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Requirement {
    /// `key=value` / `key==value`.
    Equals(String, String),
    /// `key!=value`.
    NotEquals(String, String),
    /// `key in (values)`.
    In(String, Vec<String>),
    /// `key notin (values)`.
    NotIn(String, Vec<String>),
    /// `key`.
    Exists(String),
    /// `!key`.
    NotExists(String),
}

impl Requirement {
    /// True when a worker with `tags` satisfies this requirement.
    pub fn matches(&self, tags: &HashMap<String, String>) -> bool {
        match self {
            Requirement::Equals(k, v) => tags.get(k) == Some(v),
            Requirement::NotEquals(k, v) => tags.get(k) != Some(v),
            Requirement::In(k, vs) => tags.get(k).is_some_and(|t| vs.contains(t)),
            Requirement::NotIn(k, vs) => !tags.get(k).is_some_and(|t| vs.contains(t)),
            Requirement::Exists(k) => tags.contains_key(k),
            Requirement::NotExists(k) => !tags.contains_key(k),
        }
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Requirement::Equals(k, v) => write!(f, "{k}={v}"),
            Requirement::NotEquals(k, v) => write!(f, "{k}!={v}"),
            Requirement::In(k, vs) => write!(f, "{k} in ({})", vs.join(", ")),
            Requirement::NotIn(k, vs) => write!(f, "{k} notin ({})", vs.join(", ")),
            Requirement::Exists(k) => write!(f, "{k}"),
            Requirement::NotExists(k) => write!(f, "!{k}"),
        }
    }
}

/// A parsed worker selector: every requirement must hold.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Selector {
    /// The requirements, in the order written.
    pub requirements: Vec<Requirement>,
}

impl Selector {
    /// Parses `text` (see the module docs). An empty or all-blank text is
    /// the empty selector, which matches every worker.
    ///
    /// Errors: `InvalidArgument` naming the offending part: longer than
    /// [`MAX_SELECTOR_BYTES`], more than [`MAX_REQUIREMENTS`] requirements,
    /// a set of more than [`MAX_SET_VALUES`] values or none, a bad
    /// character, an unclosed parenthesis, an empty requirement.
    pub fn parse(text: &str) -> Result<Selector> {
        if text.len() > MAX_SELECTOR_BYTES {
            return Err(Error::invalid(format!(
                "worker_selector is at most {MAX_SELECTOR_BYTES} bytes, got {}",
                text.len()
            )));
        }
        if let Some(c) = text.chars().find(|c| !c.is_ascii_graphic() && *c != ' ') {
            return Err(Error::invalid(format!(
                "worker_selector {text:?}: character {c:?} is not allowed (printable ASCII only)"
            )));
        }
        let mut requirements = Vec::new();
        if text.trim().is_empty() {
            return Ok(Selector { requirements });
        }
        for part in split_top_level(text)? {
            if requirements.len() == MAX_REQUIREMENTS {
                return Err(Error::invalid(format!(
                    "worker_selector {text:?} has more than {MAX_REQUIREMENTS} requirements"
                )));
            }
            requirements.push(parse_requirement(text, part.trim())?);
        }
        Ok(Selector { requirements })
    }

    /// True when a worker with `tags` satisfies every requirement.
    pub fn matches(&self, tags: &HashMap<String, String>) -> bool {
        self.requirements.iter().all(|r| r.matches(tags))
    }

    /// True for the selector that matches every worker.
    pub fn is_empty(&self) -> bool {
        self.requirements.is_empty()
    }
}

impl fmt::Display for Selector {
    /// The canonical text: requirements joined by `, `. Parsing it gives
    /// the same selector.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, r) in self.requirements.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{r}")?;
        }
        Ok(())
    }
}

/// Splits at the commas that are not inside parentheses.
fn split_top_level(text: &str) -> Result<Vec<&str>> {
    let mut parts = Vec::new();
    let mut depth = 0u32;
    let mut start = 0;
    for (i, c) in text.char_indices() {
        match c {
            '(' if depth == 0 => depth = 1,
            '(' => {
                return Err(Error::invalid(format!(
                    "worker_selector {text:?}: nested parenthesis"
                )))
            }
            ')' if depth == 1 => depth = 0,
            ')' => {
                return Err(Error::invalid(format!(
                    "worker_selector {text:?}: ')' without '('"
                )))
            }
            ',' if depth == 0 => {
                parts.push(&text[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(Error::invalid(format!(
            "worker_selector {text:?}: '(' is not closed"
        )));
    }
    parts.push(&text[start..]);
    Ok(parts)
}

/// Characters a key or value may not contain.
fn is_special(c: char) -> bool {
    matches!(c, ' ' | ',' | '=' | '!' | '(' | ')')
}

fn token<'a>(text: &str, what: &str, s: &'a str, allow_empty: bool) -> Result<&'a str> {
    let s = s.trim();
    if s.is_empty() && !allow_empty {
        return Err(Error::invalid(format!(
            "worker_selector {text:?}: a requirement lacks its {what}"
        )));
    }
    if let Some(c) = s.chars().find(|c| is_special(*c)) {
        return Err(Error::invalid(format!(
            "worker_selector {text:?}: {what} {s:?} contains {c:?}"
        )));
    }
    if s.len() > 256 {
        return Err(Error::invalid(format!(
            "worker_selector {text:?}: a {what} is at most 256 bytes"
        )));
    }
    Ok(s)
}

fn parse_requirement(text: &str, part: &str) -> Result<Requirement> {
    if part.is_empty() {
        return Err(Error::invalid(format!(
            "worker_selector {text:?}: empty requirement (two commas, or a comma at an end)"
        )));
    }
    if let Some(key) = part.strip_prefix('!') {
        return Ok(Requirement::NotExists(
            token(text, "key", key, false)?.into(),
        ));
    }
    if let Some((k, v)) = part.split_once("!=") {
        return Ok(Requirement::NotEquals(
            token(text, "key", k, false)?.into(),
            token(text, "value", v, true)?.into(),
        ));
    }
    if let Some((k, v)) = part.split_once("==").or_else(|| part.split_once('=')) {
        return Ok(Requirement::Equals(
            token(text, "key", k, false)?.into(),
            token(text, "value", v, true)?.into(),
        ));
    }
    if let Some(open) = part.find('(') {
        let head = part[..open].trim_end();
        let (key, negated) = if let Some(k) = head.strip_suffix(" notin") {
            (k, true)
        } else if let Some(k) = head.strip_suffix(" in") {
            (k, false)
        } else {
            return Err(Error::invalid(format!(
                "worker_selector {text:?}: expected `key in (...)` or `key notin (...)` in {part:?}"
            )));
        };
        let key = token(text, "key", key, false)?.to_string();
        let Some(body) = part[open + 1..].strip_suffix(')') else {
            return Err(Error::invalid(format!(
                "worker_selector {text:?}: text after ')' in {part:?}"
            )));
        };
        let mut values = Vec::new();
        for v in body.split(',') {
            let v = token(text, "value", v, false)?.to_string();
            if !values.contains(&v) {
                values.push(v);
            }
        }
        if values.len() > MAX_SET_VALUES {
            return Err(Error::invalid(format!(
                "worker_selector {text:?}: a set has at most {MAX_SET_VALUES} values"
            )));
        }
        return Ok(if negated {
            Requirement::NotIn(key, values)
        } else {
            Requirement::In(key, values)
        });
    }
    Ok(Requirement::Exists(token(text, "key", part, false)?.into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn parses_every_form() {
        let s = Selector::parse(
            "gpu=true, region in (eu, us),!spot, zone!=a, tier==1, ssd, os notin (win)",
        )
        .unwrap();
        assert_eq!(
            s.requirements,
            vec![
                Requirement::Equals("gpu".into(), "true".into()),
                Requirement::In("region".into(), vec!["eu".into(), "us".into()]),
                Requirement::NotExists("spot".into()),
                Requirement::NotEquals("zone".into(), "a".into()),
                Requirement::Equals("tier".into(), "1".into()),
                Requirement::Exists("ssd".into()),
                Requirement::NotIn("os".into(), vec!["win".into()]),
            ]
        );
        assert_eq!(Selector::parse(&s.to_string()).unwrap(), s);
    }

    #[test]
    fn matches_like_kubernetes() {
        let s = Selector::parse("gpu=true,region in (eu,us),!spot").unwrap();
        assert!(s.matches(&tags(&[("gpu", "true"), ("region", "eu")])));
        assert!(!s.matches(&tags(&[("gpu", "true"), ("region", "asia")])));
        assert!(!s.matches(&tags(&[("gpu", "true"), ("region", "us"), ("spot", "")])));
        assert!(!s.matches(&tags(&[("region", "us")])));
        let n = Selector::parse("zone!=a, os notin (win)").unwrap();
        assert!(n.matches(&tags(&[])));
        assert!(!n.matches(&tags(&[("zone", "a")])));
        assert!(!n.matches(&tags(&[("os", "win")])));
        assert!(Selector::parse("  ").unwrap().matches(&tags(&[])));
        assert!(Selector::parse("k=").unwrap().matches(&tags(&[("k", "")])));
    }

    #[test]
    fn refuses_malformed_selectors() {
        for bad in [
            "gpu=true,",
            ",gpu",
            "a in (x",
            "a in x)",
            "a in ()",
            "a in (x,,y)",
            "a within (x)",
            "a in (x) y",
            "=v",
            "!",
            "a=b=c",
            "a in ((x))",
            "tab\tkey",
            "k=é",
        ] {
            let err = Selector::parse(bad).unwrap_err();
            assert!(matches!(err, Error::InvalidArgument(_)), "{bad}: {err:?}");
        }
        assert!(Selector::parse(&"a=b,".repeat(40)).is_err());
        assert!(Selector::parse(&"x".repeat(2000)).is_err());
    }
}

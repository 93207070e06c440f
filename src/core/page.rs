//! Pagination shared by every engine: page sizes and the opaque page
//! tokens of the list RPCs. A token is the hex of `kind:value`, where the
//! kind names the listing and its filters (`JobQuery::page_kind` and the
//! like) and the value is the last key of the page (a plan id, a job's
//! row); a token of another kind (another listing, or the same one with
//! other filters), or not made by this codec, is refused. A token is not
//! signed: one written by hand is a cursor like any other, and shows no
//! more than the listing itself does.

use crate::error::{Error, Result};

/// Page size when the request gives none.
pub const DEFAULT_PAGE: u32 = 100;
/// Largest page size a request may ask for.
pub const MAX_PAGE: u32 = 1000;

/// The page size for a requested `n` (0: [`DEFAULT_PAGE`]).
///
/// Errors: `InvalidArgument` over [`MAX_PAGE`].
pub fn page_size(n: u32) -> Result<usize> {
    match n {
        0 => Ok(DEFAULT_PAGE as usize),
        n if n <= MAX_PAGE => Ok(n as usize),
        n => Err(Error::invalid(format!(
            "page_size must be at most {MAX_PAGE}, got {n}"
        ))),
    }
}

/// The token of a page that ended at `value`, for listings of `kind`.
pub fn encode_token(kind: &str, value: &str) -> String {
    hex::encode(format!("{kind}:{value}"))
}

/// The refusal of a page token that is malformed or was made for another
/// listing or other filters (`InvalidArgument`).
pub fn bad_token() -> Error {
    Error::invalid("page_token is malformed or was made for another listing or other filters")
}

/// The version before which a page of plan `plan_id`'s versions starts:
/// a token's value is `version:plan_id` (the versions of another plan are
/// refused); past the newest version for the first page.
///
/// Errors: `InvalidArgument` for a malformed token or one made for another
/// plan.
pub fn plan_version_cursor(plan_id: &str, token: &str) -> Result<i64> {
    let Some(v) = decode_token("plan_version", token)? else {
        return Ok(i64::from(u32::MAX) + 1);
    };
    let bad = || Error::invalid("page_token is malformed or was made for another plan");
    let (version, id) = v.split_once(':').ok_or_else(bad)?;
    if id != plan_id {
        return Err(bad());
    }
    version.parse::<u32>().map(i64::from).map_err(|_| bad())
}

/// The value in `token`, a token of `kind`; `None` for the empty token
/// (the first page).
///
/// Errors: `InvalidArgument` for a token this codec did not make for `kind`.
pub fn decode_token(kind: &str, token: &str) -> Result<Option<String>> {
    if token.is_empty() {
        return Ok(None);
    }
    let raw = hex::decode(token).map_err(|_| bad_token())?;
    let text = String::from_utf8(raw).map_err(|_| bad_token())?;
    let value = text
        .strip_prefix(kind)
        .and_then(|r| r.strip_prefix(':'))
        .ok_or_else(bad_token)?;
    // Every value this codec is given (an id, numbers) is free of NUL and
    // control characters, which no store could compare alike (PostgreSQL
    // `text` cannot hold a NUL). The kind may hold any (a ListPlans
    // pattern): it is compared here, never stored.
    if value.chars().any(char::is_control) {
        return Err(bad_token());
    }
    Ok(Some(value.to_string()))
}

/// The number in a token of `kind` (a row id); 0 for the first page.
///
/// Errors: `InvalidArgument` for a token that is not one of these.
pub fn decode_number(kind: &str, token: &str) -> Result<i64> {
    match decode_token(kind, token)? {
        None => Ok(0),
        Some(v) => v.parse().map_err(|_| bad_token()),
    }
}

/// Cuts `items` (fetched with one item more than `limit`) to the page and
/// makes the next page's token from its last item's key, or an empty
/// token when nothing follows.
pub fn split_page<T>(
    items: Vec<T>,
    limit: usize,
    kind: &str,
    key: impl Fn(&T) -> String,
) -> (Vec<T>, String) {
    split_page_within(items, limit, kind, key, |_| 0, 0)
}

/// Byte budget of one page whose items can be large (schedules with their
/// inputs, workers with their agentic units): under the 4 MiB a gRPC
/// client takes by default (grpcurl, grpcio), with room for the rest of
/// the page.
pub const PAGE_BYTES: usize = 3 * 1024 * 1024;

/// [`split_page`], and the page also ends before the item that would
/// take the `size` of its items past `budget` bytes (its first item is
/// always on it, so that listing moves on).
pub fn split_page_within<T>(
    mut items: Vec<T>,
    limit: usize,
    kind: &str,
    key: impl Fn(&T) -> String,
    size: impl Fn(&T) -> usize,
    budget: usize,
) -> (Vec<T>, String) {
    let mut used = 0usize;
    let mut n = 0;
    for item in &items {
        let s = size(item);
        if n == limit || (n > 0 && used.saturating_add(s) > budget) {
            break;
        }
        used = used.saturating_add(s);
        n += 1;
    }
    if n == items.len() {
        return (items, String::new());
    }
    items.truncate(n);
    let next = items
        .last()
        .map(|l| encode_token(kind, &key(l)))
        .unwrap_or_default();
    (items, next)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_ends_at_its_count_or_its_byte_budget() {
        let items: Vec<usize> = vec![4, 4, 4, 4];
        let key = |i: &usize| i.to_string();
        let (page, next) = split_page_within(items.clone(), 3, "k", key, |&s| s, 100);
        assert_eq!((page.len(), next.is_empty()), (3, false));
        let (page, next) = split_page_within(items.clone(), 3, "k", key, |&s| s, 8);
        assert_eq!((page.len(), next.is_empty()), (2, false));
        // The first item is on the page whatever its size.
        let (page, next) = split_page_within(items.clone(), 3, "k", key, |&s| s, 1);
        assert_eq!((page.len(), next.is_empty()), (1, false));
        let (page, next) = split_page_within(items[..3].to_vec(), 3, "k", key, |&s| s, 12);
        assert_eq!((page.len(), next.is_empty()), (3, true));
        let (page, next) = split_page(items, 5, "k", key);
        assert_eq!((page.len(), next.is_empty()), (4, true));
    }

    #[test]
    fn tokens_round_trip_and_refuse_other_kinds() {
        let t = encode_token("plan", "a:b");
        assert_eq!(decode_token("plan", &t).unwrap().as_deref(), Some("a:b"));
        assert_eq!(decode_token("plan", "").unwrap(), None);
        // a kind with a control character (a ListPlans pattern) is fine
        let t = encode_token("plan/a\t*", "a");
        assert_eq!(decode_token("plan/a\t*", &t).unwrap().as_deref(), Some("a"));
        for bad in [
            encode_token("job", "1"),
            "zz".into(),
            hex::encode("plan"),
            encode_token("plan", "a\0b"),
            encode_token("plan", "a\n"),
        ] {
            let e = decode_token("plan", &bad).unwrap_err();
            assert!(matches!(e, Error::InvalidArgument(_)), "{bad}: {e:?}");
        }
        assert_eq!(
            decode_number("job", &encode_token("job", "42")).unwrap(),
            42
        );
        assert!(decode_number("job", &encode_token("job", "x")).is_err());
    }

    #[test]
    fn page_sizes_and_splits() {
        assert_eq!(page_size(0).unwrap(), 100);
        assert_eq!(page_size(1000).unwrap(), 1000);
        assert!(page_size(1001).is_err());
        let (page, next) = split_page(vec![1, 2, 3], 2, "job", |n| n.to_string());
        assert_eq!(page, vec![1, 2]);
        assert_eq!(decode_number("job", &next).unwrap(), 2);
        let (page, next) = split_page(vec![1, 2], 2, "job", |n| n.to_string());
        assert_eq!((page, next), (vec![1, 2], String::new()));
    }
}

use http::{
    header::{IF_MATCH, IF_NONE_MATCH},
    HeaderMap, Method,
};

use super::{ETag, ETagList, Expected, InvalidPrecondition, PreconditionRejection};

/// The entity-tag preconditions of a request: `If-Match` and `If-None-Match`.
///
/// Evaluate them against the resource's current ETag with [`evaluate`](Self::evaluate)
/// (reads, create-only writes), or turn them into the version condition of a single
/// conditional UPDATE with [`expected`](Self::expected) (writes: no read first).
///
/// ```
/// use http::{HeaderMap, HeaderValue, Method};
/// use tower_idempotency::version::{ETag, Preconditions, PreconditionRejection, Version};
/// let mut headers = HeaderMap::new();
/// headers.insert("if-match", HeaderValue::from_static("\"7\""));
/// let pre = Preconditions::from_headers(&headers).unwrap();
/// let v7 = ETag::from(Version::new(7));
/// let v8 = ETag::from(Version::new(8));
/// assert!(pre.evaluate(&Method::PUT, Some(&v7)).is_ok());
/// assert!(matches!(
///     pre.evaluate(&Method::PUT, Some(&v8)),
///     Err(PreconditionRejection::Failed { current: Some(_) })
/// ));
/// assert!(pre.expected().accepts(Version::new(7)));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Preconditions {
    if_match: Option<ETagList>,
    if_none_match: Option<ETagList>,
}

impl Preconditions {
    /// Parses `If-Match` and `If-None-Match` (every line of each). Malformed values are an
    /// error (a 400), never ignored.
    pub fn from_headers(headers: &HeaderMap) -> Result<Self, InvalidPrecondition> {
        Ok(Self {
            if_match: ETagList::from_headers(headers, &IF_MATCH)?,
            if_none_match: ETagList::from_headers(headers, &IF_NONE_MATCH)?,
        })
    }

    /// Preconditions from already parsed values.
    pub fn new(if_match: Option<ETagList>, if_none_match: Option<ETagList>) -> Self {
        Self {
            if_match,
            if_none_match,
        }
    }

    /// The `If-Match` list, if sent.
    pub fn if_match(&self) -> Option<&ETagList> {
        self.if_match.as_ref()
    }

    /// The `If-None-Match` list, if sent.
    pub fn if_none_match(&self) -> Option<&ETagList> {
        self.if_none_match.as_ref()
    }

    /// True when the request carries neither header.
    pub fn is_empty(&self) -> bool {
        self.if_match.is_none() && self.if_none_match.is_none()
    }

    /// Requires `If-Match` (a route that must not lose updates): without it, a 428
    /// [`PreconditionRejection::Required`] telling the client to send the ETag it got from a
    /// GET.
    pub fn require_if_match(self) -> Result<Self, PreconditionRejection> {
        if self.if_match.is_some() {
            Ok(self)
        } else {
            Err(PreconditionRejection::Required)
        }
    }

    /// Evaluates the preconditions in RFC 9110 §13.2.2 order against `current`, the ETag of
    /// the resource's current representation (`None`: the resource does not exist).
    ///
    /// 1. `If-Match`: on a missing resource it fails (even `*`); otherwise it passes when a
    ///    listed tag matches `current` by *strong* comparison (weak tags never match) or it
    ///    is `*`. Failing is 412 carrying the current ETag.
    /// 2. `If-None-Match`: on a missing resource it passes (so `If-None-Match: *` makes a
    ///    create-only PUT); otherwise it fails when `*` or a tag matches by *weak*
    ///    comparison: 304 with the ETag for GET and HEAD, 412 for other methods.
    /// 3. A missing resource with no `If-None-Match` is 404.
    ///
    /// `Ok(())` means: perform the method.
    pub fn evaluate(
        &self,
        method: &Method,
        current: Option<&ETag>,
    ) -> Result<(), PreconditionRejection> {
        if let Some(if_match) = &self.if_match {
            match current {
                Some(tag) if if_match.matches_strong(tag) => {}
                _ => {
                    return Err(PreconditionRejection::Failed {
                        current: current.cloned(),
                    })
                }
            }
        }
        let Some(current) = current else {
            return if self.if_none_match.is_some() {
                Ok(())
            } else {
                Err(PreconditionRejection::NotFound)
            };
        };
        if let Some(if_none_match) = &self.if_none_match {
            if if_none_match.matches_weak(current) {
                return Err(if method == Method::GET || method == Method::HEAD {
                    PreconditionRejection::NotModified {
                        current: current.clone(),
                    }
                } else {
                    PreconditionRejection::Failed {
                        current: Some(current.clone()),
                    }
                });
            }
        }
        Ok(())
    }

    /// The versions a conditional update may overwrite, so that the whole precondition is
    /// decided by the UPDATE's own WHERE clause instead of a read before it:
    ///
    /// - no `If-Match` or `If-Match: *`: any existing version;
    /// - `If-Match` tags: the versions of its strong tags made by `ETag::from(version)`
    ///   (weak and foreign tags match nothing, so a list of only those is always a conflict);
    /// - `If-None-Match: *`: nothing (every existing row is a conflict);
    /// - `If-None-Match` tags: excluding their versions (weak comparison).
    ///
    /// Map the update's outcome with
    /// [`VersionedUpdate::into_http`](crate::version::VersionedUpdate::into_http).
    pub fn expected(&self) -> Expected {
        let mut expected = match &self.if_match {
            None | Some(ETagList::Any) => Expected::any(),
            Some(ETagList::Tags(tags)) => Expected::one_of(tags.iter().filter_map(ETag::version)),
        };
        match &self.if_none_match {
            None => {}
            Some(ETagList::Any) => expected = Expected::nothing(),
            Some(ETagList::Tags(tags)) => {
                expected = expected.excluding(tags.iter().filter_map(ETag::opaque_version));
            }
        }
        expected
    }
}

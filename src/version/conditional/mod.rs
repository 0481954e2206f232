//! The HTTP half of optimistic concurrency: entity tags, RFC 9110 preconditions, the
//! rejections they produce and (feature `axum`) their extractor.

#[cfg(feature = "axum")]
mod axum;
mod etag;
mod precondition;
mod rejection;
mod tag_list;

use super::{Expected, InsertOutcome, Version, VersionedUpdate};

#[cfg(feature = "axum")]
pub use self::axum::RequireIfMatch;
pub use etag::{ETag, InvalidETag};
pub use precondition::Preconditions;
pub use rejection::{
    PreconditionRejection, INVALID_PRECONDITION_TYPE, NOT_FOUND_TYPE, PRECONDITION_FAILED_TYPE,
    PRECONDITION_REQUIRED_TYPE,
};
pub use tag_list::{ETagList, InvalidPrecondition};

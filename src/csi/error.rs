//! The one error type of the CSI services, mapped to a gRPC status in one place.

use crate::config::volume::VolumeError;
use crate::mounter::{FailureKind, MountError};
use crate::s3::S3Error;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    AlreadyExists(String),
    #[error("{0}")]
    Aborted(String),
    #[error("{0}")]
    PermissionDenied(String),
    #[error("{0}")]
    FailedPrecondition(String),
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    DeadlineExceeded(String),
    #[error("{0}")]
    Internal(String),
}

pub type Result<T, E = CsiError> = std::result::Result<T, E>;

impl CsiError {
    pub fn invalid(msg: impl Into<String>) -> Self {
        Self::InvalidArgument(msg.into())
    }

    pub fn code(&self) -> Code {
        match self {
            CsiError::InvalidArgument(_) => Code::InvalidArgument,
            CsiError::NotFound(_) => Code::NotFound,
            CsiError::AlreadyExists(_) => Code::AlreadyExists,
            CsiError::Aborted(_) => Code::Aborted,
            CsiError::PermissionDenied(_) => Code::PermissionDenied,
            CsiError::FailedPrecondition(_) => Code::FailedPrecondition,
            CsiError::Unavailable(_) => Code::Unavailable,
            CsiError::DeadlineExceeded(_) => Code::DeadlineExceeded,
            CsiError::Internal(_) => Code::Internal,
        }
    }
}

/// Longest message a status carries. Messages quote the offending input, which may be
/// megabytes; gRPC sends the message in a trailer, and one over HTTP/2's header-list limit
/// (16 KiB by default) turns the clear InvalidArgument into a protocol error.
pub const MAX_MESSAGE: usize = 1024;

fn bounded(mut msg: String) -> String {
    if msg.len() > MAX_MESSAGE {
        let mut end = MAX_MESSAGE;
        while !msg.is_char_boundary(end) {
            end -= 1;
        }
        msg.truncate(end);
        msg.push_str("… (truncated)");
    }
    msg
}

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Self {
        Status::new(e.code(), bounded(e.to_string()))
    }
}

impl From<VolumeError> for CsiError {
    fn from(e: VolumeError) -> Self {
        CsiError::InvalidArgument(e.to_string())
    }
}

impl From<S3Error> for CsiError {
    fn from(e: S3Error) -> Self {
        let msg = e.to_string();
        match e {
            S3Error::NoSuchBucket => CsiError::NotFound(msg),
            S3Error::NotFound => CsiError::NotFound(msg),
            S3Error::AccessDenied(_) => CsiError::PermissionDenied(msg),
            S3Error::Unreachable(_) => CsiError::Unavailable(msg),
            S3Error::Timeout => CsiError::DeadlineExceeded(msg),
            S3Error::PreconditionFailed | S3Error::NotImplemented(_) | S3Error::Other(_) => {
                CsiError::Internal(msg)
            }
        }
    }
}

impl From<MountError> for CsiError {
    fn from(e: MountError) -> Self {
        match e.kind {
            FailureKind::NotFound => CsiError::NotFound(e.message),
            FailureKind::InvalidArgument => CsiError::InvalidArgument(e.message),
            FailureKind::PermissionDenied => CsiError::PermissionDenied(e.message),
            FailureKind::Timeout => CsiError::DeadlineExceeded(e.message),
            FailureKind::Other => CsiError::Internal(e.message),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_messages_are_truncated_on_a_char_boundary() {
        let s: Status = CsiError::invalid(format!("volume_id {}", "é".repeat(1 << 20))).into();
        assert!(s.message().len() < MAX_MESSAGE + 32);
        assert!(s.message().starts_with("volume_id "));
        assert_eq!(s.code(), Code::InvalidArgument);
    }
}

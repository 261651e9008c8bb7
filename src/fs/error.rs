//! The file system's one error type, mapped to an errno once, at the FUSE edge.

use crate::s3::S3Error;

#[derive(Debug, thiserror::Error)]
pub enum FsError {
    #[error("no such file or directory")]
    NotFound,
    #[error("file exists")]
    Exists,
    #[error("directory not empty")]
    NotEmpty,
    #[error("not a directory")]
    NotDir,
    #[error("is a directory")]
    IsDir,
    #[error("read-only file system")]
    ReadOnly,
    #[error("file is busy: {0}")]
    Busy(&'static str),
    #[error("invalid name")]
    InvalidName,
    #[error("name too long")]
    NameTooLong,
    #[error("bad file handle")]
    BadHandle,
    #[error("not supported: {0}")]
    Unsupported(&'static str),
    #[error("renaming directories is not supported (EXDEV lets mv copy instead)")]
    CrossDevice,
    #[error("invalid argument: {0}")]
    Invalid(&'static str),
    #[error("no space left for staged data (--cache-size)")]
    NoSpace,
    #[error("file too large")]
    TooBig,
    #[error("the object changed in S3 since it was opened")]
    Stale,
    #[error("another client replaced the object while it was edited here")]
    Conflict,
    #[error("local staging I/O: {0}")]
    Local(String),
    #[error("no such attribute")]
    NoAttr,
    #[error("extended attributes too large for S3's 2 KiB of user metadata")]
    XattrTooBig,
    #[error("upload failed earlier: {0}")]
    UploadFailed(S3Error),
    #[error(transparent)]
    S3(#[from] S3Error),
}

impl FsError {
    pub fn errno(&self) -> i32 {
        match self {
            FsError::NotFound => libc::ENOENT,
            FsError::Exists => libc::EEXIST,
            FsError::NotEmpty => libc::ENOTEMPTY,
            FsError::NotDir => libc::ENOTDIR,
            FsError::IsDir => libc::EISDIR,
            FsError::ReadOnly => libc::EROFS,
            FsError::Busy(_) => libc::EBUSY,
            FsError::InvalidName => libc::EINVAL,
            FsError::NameTooLong => libc::ENAMETOOLONG,
            FsError::BadHandle => libc::EBADF,
            FsError::Unsupported(_) => libc::EOPNOTSUPP,
            FsError::CrossDevice => libc::EXDEV,
            FsError::Invalid(_) => libc::EINVAL,
            FsError::NoSpace => libc::ENOSPC,
            FsError::TooBig => libc::EFBIG,
            FsError::Stale => libc::ESTALE,
            // The edit is not in S3 (it is in lost+found): the close must fail.
            FsError::Conflict => libc::EIO,
            FsError::Local(_) => libc::EIO,
            FsError::NoAttr => libc::ENODATA,
            FsError::XattrTooBig => libc::E2BIG,
            // A failed upload is reported as EIO whatever S3 said: the data is not durable.
            FsError::UploadFailed(_) => libc::EIO,
            FsError::S3(e) => e.errno(),
        }
    }
}

pub type FsResult<T> = Result<T, FsError>;

//! Where the bucket is: the part of a mount's configuration the S3 client is built from.

/// Where and how to reach the bucket. Never holds credentials.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Endpoint {
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
    pub force_path_style: bool,
}

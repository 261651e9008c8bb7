//! Typed parsing of what Kubernetes hands the CSI driver: volume handles, volume context
//! (PV `volumeAttributes`, or what CreateVolume returned), StorageClass parameters and
//! Secrets. Everything is validated here, once; the gRPC adapters only map the errors.
//!
//! Key names are the same everywhere the driver reads them:
//! - volume context / StorageClass: `bucket`, `prefix` (`basePrefix` in a StorageClass),
//!   `region`, `endpointUrl`, `forcePathStyle`;
//! - Secrets: `accessKeyId`, `secretAccessKey`, optional `sessionToken`;
//! - who the mounter acts for: `authenticationSource` (`driver` or `pod`), `stsEndpointUrl`;
//!   with `pod`, kubelet's `csi.storage.k8s.io/serviceAccount.tokens` and pod info
//!   ([`PodAuth`]).
//!
//! Keys that contain a `/` (`csi.storage.k8s.io/pod.name`,
//! `storage.kubernetes.io/csiProvisionerIdentity`, ...) belong to Kubernetes and are
//! ignored; any other unknown key is an error, so that a typo fails loudly instead of being
//! silently dropped.

use super::mount::{normalize_prefix, validate_bucket_name, BucketSource, MountConfig};
use super::{Endpoint, MountOptionError};
use std::collections::HashMap;

pub const KEY_BUCKET: &str = "bucket";
pub const KEY_PREFIX: &str = "prefix";
pub const KEY_BASE_PREFIX: &str = "basePrefix";
pub const KEY_REGION: &str = "region";
pub const KEY_ENDPOINT_URL: &str = "endpointUrl";
pub const KEY_FORCE_PATH_STYLE: &str = "forcePathStyle";
pub const KEY_CACHE_SIZE: &str = "cacheSize";
pub const KEY_KEEP_CACHE: &str = "keepCache";
pub const KEY_AUTHENTICATION_SOURCE: &str = "authenticationSource";
pub const KEY_STS_ENDPOINT_URL: &str = "stsEndpointUrl";

/// What kubelet adds to the volume context when the CSIDriver asks for it
/// (`tokenRequests`, `podInfoOnMount`).
pub const CTX_TOKENS: &str = "csi.storage.k8s.io/serviceAccount.tokens";
pub const CTX_SERVICE_ACCOUNT: &str = "csi.storage.k8s.io/serviceAccount.name";
pub const CTX_POD_NAMESPACE: &str = "csi.storage.k8s.io/pod.namespace";
pub const CTX_POD_NAME: &str = "csi.storage.k8s.io/pod.name";
/// The audience of the token for STS AssumeRoleWithWebIdentity (IRSA).
pub const AUDIENCE_STS: &str = "sts.amazonaws.com";
/// The audience of the token for the EKS Pod Identity agent.
pub const AUDIENCE_POD_IDENTITY: &str = "pods.eks.amazonaws.com";

pub const SECRET_ACCESS_KEY_ID: &str = "accessKeyId";
pub const SECRET_SECRET_ACCESS_KEY: &str = "secretAccessKey";
pub const SECRET_SESSION_TOKEN: &str = "sessionToken";

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum VolumeError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    MountOption(#[from] MountOptionError),
}

fn invalid(msg: impl Into<String>) -> VolumeError {
    VolumeError::Invalid(msg.into())
}

/// Static S3 credentials from a Kubernetes Secret. `Debug` never shows the values.
#[derive(Clone, PartialEq, Eq)]
pub struct Credentials {
    access_key_id: String,
    secret_access_key: String,
    session_token: Option<String>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("access_key_id", &"<redacted>")
            .field("secret_access_key", &"<redacted>")
            .field(
                "session_token",
                &self.session_token.as_ref().map(|_| "<redacted>"),
            )
            .finish()
    }
}

impl Credentials {
    pub fn new(access_key_id: &str, secret_access_key: &str, session_token: Option<&str>) -> Self {
        Self {
            access_key_id: access_key_id.to_string(),
            secret_access_key: secret_access_key.to_string(),
            session_token: session_token.map(str::to_string),
        }
    }

    /// `None` when the Secret carries no keys (use the default credential chain). Errors
    /// name keys, never values. Unknown keys are ignored: one Secret may serve several tools.
    pub fn from_secrets(secrets: &HashMap<String, String>) -> Result<Option<Self>, VolumeError> {
        let get = |k: &str| secrets.get(k).map(|v| v.trim()).filter(|v| !v.is_empty());
        match (
            get(SECRET_ACCESS_KEY_ID),
            get(SECRET_SECRET_ACCESS_KEY),
            get(SECRET_SESSION_TOKEN),
        ) {
            (None, None, None) => Ok(None),
            (Some(id), Some(secret), token) => Ok(Some(Self::new(id, secret, token))),
            (None, _, _) => Err(invalid(format!(
                "secret has no {SECRET_ACCESS_KEY_ID:?} (needs {SECRET_ACCESS_KEY_ID} and {SECRET_SECRET_ACCESS_KEY})"
            ))),
            (Some(_), None, _) => Err(invalid(format!(
                "secret has {SECRET_ACCESS_KEY_ID:?} but no {SECRET_SECRET_ACCESS_KEY:?}"
            ))),
        }
    }

    pub fn access_key_id(&self) -> &str {
        &self.access_key_id
    }

    pub fn secret_access_key(&self) -> &str {
        &self.secret_access_key
    }

    pub fn session_token(&self) -> Option<&str> {
        self.session_token.as_deref()
    }

    /// The environment the AWS SDK's default chain reads first. The only way credentials
    /// reach a mounter process: never argv, never a file name, never a log line.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("AWS_ACCESS_KEY_ID", self.access_key_id.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_access_key.clone()),
        ];
        if let Some(t) = &self.session_token {
            env.push(("AWS_SESSION_TOKEN", t.clone()));
        }
        env
    }

    /// Removes every secret value from `text` (for messages that come from a child process).
    pub fn scrub(&self, text: &str) -> String {
        let mut out = text.to_string();
        for v in [Some(&self.secret_access_key), self.session_token.as_ref()]
            .into_iter()
            .flatten()
        {
            if v.len() >= 4 {
                out = out.replace(v.as_str(), "<redacted>");
            }
        }
        out
    }
}

/// A volume handle: `bucket` or `bucket/prefix/...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VolumeHandle {
    pub bucket: String,
    /// Normalised: empty or ending in `/`.
    pub prefix: String,
}

impl VolumeHandle {
    pub fn parse(handle: &str) -> Result<Self, VolumeError> {
        let (bucket, prefix) = handle.split_once('/').unwrap_or((handle, ""));
        validate_bucket_name(bucket)
            .map_err(|e| invalid(format!("volume handle {handle:?}: {e}")))?;
        let prefix = normalize_prefix(prefix)
            .map_err(|e| invalid(format!("volume handle {handle:?}: {e}")))?;
        Ok(Self {
            bucket: bucket.to_string(),
            prefix,
        })
    }

    /// The handle string for this bucket and prefix (inverse of [`VolumeHandle::parse`]).
    pub fn id(&self) -> String {
        let p = self.prefix.trim_end_matches('/');
        if p.is_empty() {
            self.bucket.clone()
        } else {
            format!("{}/{}", self.bucket, p)
        }
    }
}

fn parse_bool(key: &str, v: &str) -> Result<bool, VolumeError> {
    match v.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" => Ok(true),
        "false" | "0" | "no" | "" => Ok(false),
        _ => Err(invalid(format!("{key}: expected true or false, got {v:?}"))),
    }
}

fn is_kubernetes_key(k: &str) -> bool {
    k.contains('/')
}

/// Where the bucket is, as the volume context or the driver's defaults say.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct S3Location {
    pub region: Option<String>,
    pub endpoint_url: Option<String>,
    pub force_path_style: Option<bool>,
}

impl S3Location {
    /// `self` where set, else `defaults`.
    pub fn or(&self, defaults: &Endpoint) -> Endpoint {
        Endpoint {
            region: self.region.clone().or_else(|| defaults.region.clone()),
            endpoint_url: self
                .endpoint_url
                .clone()
                .or_else(|| defaults.endpoint_url.clone()),
            force_path_style: self.force_path_style.unwrap_or(defaults.force_path_style),
        }
    }

    fn set(&mut self, key: &str, value: &str) -> Result<bool, VolumeError> {
        match key {
            KEY_REGION => {
                let mut probe = MountConfig::new(BucketSource::parse("probe").expect("valid"));
                probe.apply_option("region", Some(value))?;
                self.region = probe.endpoint.region;
            }
            KEY_ENDPOINT_URL => {
                let mut probe = MountConfig::new(BucketSource::parse("probe").expect("valid"));
                probe.apply_option("endpoint-url", Some(value))?;
                self.endpoint_url = probe.endpoint.endpoint_url;
            }
            KEY_FORCE_PATH_STYLE => self.force_path_style = Some(parse_bool(key, value)?),
            _ => return Ok(false),
        }
        Ok(true)
    }
}

/// A volume's data cache on the node (`cacheSize`, `keepCache`), as a StorageClass or a
/// PV's attributes ask for it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CacheRequest {
    /// Bytes of node-local disk (staged edits and cached data together); `Some(0)`: no
    /// data cache; `None`: as the mount options say.
    pub size: Option<u64>,
    /// The cached data outlives the volume's last unpublish on the node.
    pub keep: Option<bool>,
}

impl CacheRequest {
    fn set(&mut self, key: &str, value: &str) -> Result<bool, VolumeError> {
        match key {
            KEY_CACHE_SIZE => {
                let size = super::units::parse_size(value)
                    .map_err(|e| invalid(format!("{KEY_CACHE_SIZE}: {e}")))?;
                self.size = Some(size);
            }
            KEY_KEEP_CACHE => self.keep = Some(parse_bool(key, value)?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The attributes CreateVolume hands on to the volume's context.
    pub fn context(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(s) = self.size {
            out.push((KEY_CACHE_SIZE.to_string(), super::units::format_size(s)));
        }
        if let Some(k) = self.keep {
            out.push((KEY_KEEP_CACHE.to_string(), k.to_string()));
        }
        out
    }
}

/// Whose credentials the mounter uses.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AuthenticationSource {
    /// The node plugin's own (its IAM role or `awsCredentials`), or the volume's
    /// node-publish Secret.
    #[default]
    Driver,
    /// The workload pod's service account: its token, exchanged for the role annotated on
    /// it (IRSA) or by the EKS Pod Identity agent.
    Pod,
}

/// `authenticationSource` and `stsEndpointUrl`, as a StorageClass or a PV asks for them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AuthRequest {
    pub source: Option<AuthenticationSource>,
    /// Where web identity tokens are exchanged (an S3-compatible store's STS); AWS's
    /// regional STS when unset.
    pub sts_endpoint_url: Option<String>,
}

impl AuthRequest {
    fn set(&mut self, key: &str, value: &str) -> Result<bool, VolumeError> {
        match key {
            KEY_AUTHENTICATION_SOURCE => {
                self.source = Some(match value.trim() {
                    "driver" | "" => AuthenticationSource::Driver,
                    "pod" => AuthenticationSource::Pod,
                    v => {
                        return Err(invalid(format!(
                            "{KEY_AUTHENTICATION_SOURCE}: expected driver or pod, got {v:?}"
                        )))
                    }
                })
            }
            KEY_STS_ENDPOINT_URL => {
                let mut probe = MountConfig::new(BucketSource::parse("probe").expect("valid"));
                probe
                    .apply_option("endpoint-url", Some(value))
                    .map_err(|e| invalid(format!("{KEY_STS_ENDPOINT_URL}: {e}")))?;
                self.sts_endpoint_url = probe.endpoint.endpoint_url;
            }
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The attributes CreateVolume hands on to the volume's context.
    pub fn context(&self) -> Vec<(String, String)> {
        let mut out = Vec::new();
        if let Some(s) = self.source {
            let v = match s {
                AuthenticationSource::Driver => "driver",
                AuthenticationSource::Pod => "pod",
            };
            out.push((KEY_AUTHENTICATION_SOURCE.to_string(), v.to_string()));
        }
        if let Some(u) = &self.sts_endpoint_url {
            out.push((KEY_STS_ENDPOINT_URL.to_string(), u.clone()));
        }
        out
    }
}

/// A token kubelet requested for the pod's service account. `Debug` never shows it.
#[derive(Clone, PartialEq, Eq)]
pub struct ServiceAccountToken(String);

impl ServiceAccountToken {
    pub fn secret(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for ServiceAccountToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("<redacted>")
    }
}

/// The workload pod, as kubelet describes it to a volume with `authenticationSource: pod`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PodAuth {
    pub namespace: String,
    pub service_account: String,
    pub pod_name: String,
    /// For STS (IRSA), if the CSIDriver requested that audience.
    pub sts_token: Option<ServiceAccountToken>,
    /// For the EKS Pod Identity agent, if requested.
    pub pod_identity_token: Option<ServiceAccountToken>,
    pub sts_endpoint_url: Option<String>,
}

impl PodAuth {
    /// From the merged volume context. Errors name keys, never token values.
    fn parse(
        ctx: &HashMap<String, String>,
        sts_endpoint_url: Option<String>,
    ) -> Result<Self, VolumeError> {
        let need = |k: &str| {
            ctx.get(k)
                .map(|v| v.trim())
                .filter(|v| !v.is_empty())
                .map(str::to_string)
                .ok_or_else(|| {
                    invalid(format!(
                        "{KEY_AUTHENTICATION_SOURCE} is pod, but kubelet sent no {k:?} (the \
                         CSIDriver object needs podInfoOnMount and tokenRequests; the chart \
                         sets them)"
                    ))
                })
        };
        let namespace = need(CTX_POD_NAMESPACE)?;
        let service_account = need(CTX_SERVICE_ACCOUNT)?;
        let pod_name = need(CTX_POD_NAME)?;
        let raw = need(CTX_TOKENS)?;
        #[derive(serde::Deserialize)]
        struct Token {
            token: String,
        }
        let tokens: HashMap<String, Token> = serde_json::from_str(&raw).map_err(|e| {
            // serde's message may quote the input: say where it failed, nothing more.
            invalid(format!(
                "{CTX_TOKENS} is not a JSON map of audience to token (line {}, column {})",
                e.line(),
                e.column()
            ))
        })?;
        let token = |aud: &str| {
            tokens
                .get(aud)
                .map(|t| t.token.trim())
                .filter(|t| !t.is_empty())
                .map(|t| ServiceAccountToken(t.to_string()))
        };
        let (sts_token, pod_identity_token) = (token(AUDIENCE_STS), token(AUDIENCE_POD_IDENTITY));
        if sts_token.is_none() && pod_identity_token.is_none() {
            let mut audiences: Vec<&String> = tokens.keys().collect();
            audiences.sort();
            return Err(invalid(format!(
                "{CTX_TOKENS} has no token for {AUDIENCE_STS:?} or {AUDIENCE_POD_IDENTITY:?} \
                 (audiences: {audiences:?}); set the CSIDriver's tokenRequests"
            )));
        }
        Ok(Self {
            namespace,
            service_account,
            pod_name,
            sts_token,
            pod_identity_token,
            sts_endpoint_url,
        })
    }
}

/// Parsed volume context (PV `volumeAttributes` or CreateVolume's `volume_context`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VolumeContext {
    pub bucket: Option<String>,
    pub prefix: Option<String>,
    pub location: S3Location,
    pub cache: CacheRequest,
    pub auth: AuthRequest,
}

impl VolumeContext {
    pub fn parse(ctx: &HashMap<String, String>) -> Result<Self, VolumeError> {
        let mut out = Self::default();
        let mut keys: Vec<&String> = ctx.keys().collect();
        keys.sort();
        for k in keys {
            let v = &ctx[k];
            match k.as_str() {
                KEY_BUCKET => {
                    validate_bucket_name(v).map_err(|e| invalid(format!("{KEY_BUCKET}: {e}")))?;
                    out.bucket = Some(v.clone());
                }
                KEY_PREFIX => {
                    out.prefix = Some(
                        normalize_prefix(v).map_err(|e| invalid(format!("{KEY_PREFIX}: {e}")))?,
                    )
                }
                _ if is_kubernetes_key(k) => {}
                _ => {
                    if !out.location.set(k, v)? && !out.cache.set(k, v)? && !out.auth.set(k, v)? {
                        return Err(invalid(format!("unknown volume attribute {k:?}")));
                    }
                }
            }
        }
        Ok(out)
    }
}

/// StorageClass parameters of CreateVolume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StorageClassParams {
    pub bucket: String,
    /// Normalised: empty or ending in `/`.
    pub base_prefix: String,
    pub location: S3Location,
    pub cache: CacheRequest,
    pub auth: AuthRequest,
}

impl StorageClassParams {
    pub fn parse(params: &HashMap<String, String>) -> Result<Self, VolumeError> {
        let mut bucket = None;
        let mut base_prefix = String::new();
        let mut location = S3Location::default();
        let mut cache = CacheRequest::default();
        let mut auth = AuthRequest::default();
        let mut keys: Vec<&String> = params.keys().collect();
        keys.sort();
        for k in keys {
            let v = &params[k];
            match k.as_str() {
                KEY_BUCKET => {
                    validate_bucket_name(v).map_err(|e| invalid(format!("{KEY_BUCKET}: {e}")))?;
                    bucket = Some(v.clone());
                }
                KEY_BASE_PREFIX => {
                    base_prefix = normalize_prefix(v)
                        .map_err(|e| invalid(format!("{KEY_BASE_PREFIX}: {e}")))?
                }
                _ if is_kubernetes_key(k) => {}
                _ => {
                    if !location.set(k, v)? && !cache.set(k, v)? && !auth.set(k, v)? {
                        return Err(invalid(format!("unknown StorageClass parameter {k:?}")));
                    }
                }
            }
        }
        let bucket = bucket
            .ok_or_else(|| invalid(format!("StorageClass parameter {KEY_BUCKET:?} is required")))?;
        Ok(Self {
            bucket,
            base_prefix,
            location,
            cache,
            auth,
        })
    }

    /// The handle of the volume CreateVolume makes for request `name`:
    /// `bucket/basePrefix/<sanitised name>`.
    pub fn volume_for(&self, name: &str) -> Result<VolumeHandle, VolumeError> {
        let leaf = sanitize_name(name)?;
        Ok(VolumeHandle {
            bucket: self.bucket.clone(),
            prefix: format!("{}{}/", self.base_prefix, leaf),
        })
    }
}

/// A CreateVolume name as one key path component: `[A-Za-z0-9._-]`, others become `-`.
pub fn sanitize_name(name: &str) -> Result<String, VolumeError> {
    let out: String = name
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect();
    if out.is_empty() || out.chars().all(|c| c == '.') || out.len() > 128 {
        return Err(invalid(format!(
            "volume name {name:?} cannot name a prefix"
        )));
    }
    Ok(out)
}

/// Everything the node service needs to publish one volume, validated.
#[derive(Debug, Clone)]
pub struct PublishSpec {
    pub volume_id: String,
    pub source: BucketSource,
    pub endpoint: Endpoint,
    pub read_only: bool,
    /// fsGroup (CSI VOLUME_MOUNT_GROUP): the mount's gid, with group-writable modes.
    pub mount_group: Option<u32>,
    /// The PV's `mountOptions`, each checked against [`MountConfig::apply_option`].
    pub mount_flags: Vec<String>,
    pub credentials: Option<Credentials>,
    /// `authenticationSource: pod`: the workload pod's identity and tokens.
    pub pod_auth: Option<PodAuth>,
    /// The validated result of all of the above, as the mounter will see it.
    pub config: MountConfig,
    /// The data cache outlives the last unpublish on the node (`keepCache`).
    pub keep_cache: bool,
}

pub struct PublishInput<'a> {
    pub volume_id: &'a str,
    pub volume_context: &'a HashMap<String, String>,
    pub publish_context: &'a HashMap<String, String>,
    pub secrets: &'a HashMap<String, String>,
    pub mount_flags: &'a [String],
    pub volume_mount_group: &'a str,
    pub read_only: bool,
    pub defaults: &'a Endpoint,
}

impl PublishSpec {
    pub fn parse(input: PublishInput<'_>) -> Result<Self, VolumeError> {
        let handle = VolumeHandle::parse(input.volume_id)?;
        // The publish context (from a controller) may refine the volume context.
        let mut merged = input.volume_context.clone();
        merged.extend(
            input
                .publish_context
                .iter()
                .map(|(k, v)| (k.clone(), v.clone())),
        );
        let ctx = VolumeContext::parse(&merged)?;
        if let Some(b) = &ctx.bucket {
            if *b != handle.bucket {
                return Err(invalid(format!(
                    "volume attribute bucket {b:?} differs from the volume handle's bucket {:?}",
                    handle.bucket
                )));
            }
        }
        let prefix = ctx.prefix.clone().unwrap_or_else(|| handle.prefix.clone());
        let source = BucketSource::new(&handle.bucket, &prefix)?;
        let endpoint = ctx.location.or(input.defaults);
        let mount_group = match input.volume_mount_group.trim() {
            "" => None,
            g => Some(
                g.parse::<u32>()
                    .ok()
                    .filter(|g| *g != u32::MAX)
                    .ok_or_else(|| {
                        invalid(format!("volume_mount_group {g:?} is not a numeric gid"))
                    })?,
            ),
        };
        let mut config = MountConfig::new(source.clone());
        config.endpoint = endpoint.clone();
        config.allow_other = true;
        if let Some(g) = mount_group {
            config.gid = g;
            config.file_mode = 0o664;
            config.dir_mode = 0o775;
        }
        for flag in input.mount_flags {
            config.apply_option_list(flag)?;
        }
        // The volume's attribute wins over a mount option: it is the StorageClass's word.
        match ctx.cache.size {
            Some(0) => config.data_cache = false,
            Some(size) => {
                config.data_cache = true;
                config.cache_size = size;
            }
            None => {}
        }
        // Whatever the PV's options say: pods run as any uid, and without allow-other only
        // root could enter the mount; a read-only publish stays read-only.
        config.allow_other = true;
        if input.read_only {
            config.read_only = true;
        }
        let credentials = Credentials::from_secrets(input.secrets)?;
        let pod_auth = match ctx.auth.source.unwrap_or_default() {
            AuthenticationSource::Driver => None,
            AuthenticationSource::Pod if credentials.is_some() => {
                return Err(invalid(format!(
                    "{KEY_AUTHENTICATION_SOURCE} is pod, but the volume also has node-publish \
                     secrets: use one or the other"
                )))
            }
            AuthenticationSource::Pod => {
                Some(PodAuth::parse(&merged, ctx.auth.sts_endpoint_url.clone())?)
            }
        };
        Ok(Self {
            volume_id: input.volume_id.to_string(),
            source,
            endpoint,
            read_only: config.read_only,
            mount_group,
            mount_flags: input
                .mount_flags
                .iter()
                .map(|f| f.trim().to_string())
                .filter(|f| !f.is_empty())
                .collect(),
            credentials,
            pod_auth,
            keep_cache: ctx.cache.keep.unwrap_or(false) && config.data_cache,
            config,
        })
    }

    /// `BUCKET[:PREFIX]` for the mount command: the validated configuration's source, so
    /// that a `prefix=` in the PV's options counts.
    pub fn source_arg(&self) -> String {
        self.config.source.to_string()
    }

    /// Options for `s3csi mount` (without `--foreground`, source and mount point): the
    /// validated configuration, written out, so the mounter arrives at exactly it.
    pub fn mount_args(&self) -> Vec<String> {
        self.config.to_args()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn handles() {
        let h = VolumeHandle::parse("bkt").unwrap();
        assert_eq!((h.bucket.as_str(), h.prefix.as_str()), ("bkt", ""));
        let h = VolumeHandle::parse("bkt/a/b").unwrap();
        assert_eq!(h.prefix, "a/b/");
        assert_eq!(h.id(), "bkt/a/b");
        assert!(VolumeHandle::parse("bkt/../x").is_err());
        assert!(VolumeHandle::parse("Bad!").is_err());
    }

    #[test]
    fn credentials_need_both_keys_and_never_print() {
        assert_eq!(Credentials::from_secrets(&map(&[])).unwrap(), None);
        let c = Credentials::from_secrets(&map(&[
            ("accessKeyId", "AKIDEXAMPLE"),
            ("secretAccessKey", "sekrit-value"),
            ("unrelated", "x"),
        ]))
        .unwrap()
        .unwrap();
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("AKIDEXAMPLE") && !dbg.contains("sekrit"),
            "{dbg}"
        );
        assert_eq!(c.scrub("oops sekrit-value"), "oops <redacted>");
        let err = Credentials::from_secrets(&map(&[("accessKeyId", "AKIDEXAMPLE")]))
            .unwrap_err()
            .to_string();
        assert!(err.contains("secretAccessKey") && !err.contains("AKIDEXAMPLE"));
    }

    #[test]
    fn the_cache_attributes_turn_the_data_cache_on_or_off() {
        let none = HashMap::new();
        let spec = |ctx: &[(&str, &str)], flags: &[&str]| {
            let ctx = map(ctx);
            let flags: Vec<String> = flags.iter().map(|f| f.to_string()).collect();
            PublishSpec::parse(PublishInput {
                volume_id: "bkt/vol",
                volume_context: &ctx,
                publish_context: &none,
                secrets: &none,
                mount_flags: &flags,
                volume_mount_group: "",
                read_only: false,
                defaults: &Endpoint::default(),
            })
        };
        let s = spec(&[("cacheSize", "20GiB"), ("keepCache", "true")], &[]).unwrap();
        assert!(s.config.data_cache && s.keep_cache);
        assert_eq!(s.config.cache_size, 20 << 30);
        assert!(s.mount_args().contains(&"--data-cache".to_string()));
        // The attribute wins over the mount options; keepCache alone keeps nothing.
        let s = spec(
            &[("cacheSize", "0"), ("keepCache", "true")],
            &["data-cache"],
        )
        .unwrap();
        assert!(!s.config.data_cache && !s.keep_cache);
        let s = spec(&[], &["data-cache", "cache-size=1GiB"]).unwrap();
        assert!(s.config.data_cache && !s.keep_cache);
        let err = spec(&[("cacheSize", "lots")], &[]).unwrap_err();
        assert!(err.to_string().contains("cacheSize"), "{err}");
        let err = spec(&[("keepCache", "maybe")], &[]).unwrap_err();
        assert!(err.to_string().contains("keepCache"), "{err}");
        // A StorageClass hands them on to its volumes.
        let sc =
            StorageClassParams::parse(&map(&[("bucket", "bkt"), ("cacheSize", "5GiB")])).unwrap();
        assert_eq!(
            sc.cache.context(),
            vec![("cacheSize".into(), "5GiB".into())]
        );
    }

    #[test]
    fn authentication_source_pod_takes_the_pods_token_and_names_what_is_missing() {
        let spec = |ctx: &[(&str, &str)], secrets: &[(&str, &str)]| {
            let (ctx, secrets, none) = (map(ctx), map(secrets), HashMap::new());
            PublishSpec::parse(PublishInput {
                volume_id: "bkt",
                volume_context: &ctx,
                publish_context: &none,
                secrets: &secrets,
                mount_flags: &[],
                volume_mount_group: "",
                read_only: false,
                defaults: &Endpoint::default(),
            })
        };
        let tokens =
            r#"{"sts.amazonaws.com":{"token":"eyJ-secret-jwt","expirationTimestamp":"x"}}"#;
        let pod = [
            ("authenticationSource", "pod"),
            ("stsEndpointUrl", "http://127.0.0.1:5000"),
            (CTX_POD_NAMESPACE, "team-a"),
            (CTX_POD_NAME, "reader-0"),
            (CTX_SERVICE_ACCOUNT, "reader"),
            (CTX_TOKENS, tokens),
        ];
        let auth = spec(&pod, &[]).unwrap().pod_auth.unwrap();
        assert_eq!(
            (auth.namespace.as_str(), auth.service_account.as_str()),
            ("team-a", "reader")
        );
        assert_eq!(auth.sts_token.as_ref().unwrap().secret(), "eyJ-secret-jwt");
        assert!(auth.pod_identity_token.is_none());
        assert_eq!(
            auth.sts_endpoint_url.as_deref(),
            Some("http://127.0.0.1:5000")
        );
        assert!(!format!("{auth:?}").contains("eyJ-secret-jwt"));
        // Without the attribute, kubelet's tokens are ignored.
        assert!(spec(&pod[2..], &[]).unwrap().pod_auth.is_none());
        assert!(spec(&[("authenticationSource", "driver")], &[])
            .unwrap()
            .pod_auth
            .is_none());

        let err = |ctx: &[(&str, &str)], secrets: &[(&str, &str)]| {
            let e = spec(ctx, secrets).unwrap_err().to_string();
            assert!(!e.contains("eyJ-secret-jwt"), "{e}");
            e
        };
        assert!(err(&pod[..5], &[]).contains("tokenRequests"));
        assert!(err(&[pod[0], pod[2], pod[3], pod[5]], &[]).contains(CTX_SERVICE_ACCOUNT));
        let mut bad = pod;
        bad[5] = (CTX_TOKENS, r#"{"sts.amazonaws.com": "eyJ-secret-jwt"#);
        assert!(err(&bad, &[]).contains("not a JSON map"));
        bad[5] = (CTX_TOKENS, r#"{"other":{"token":"eyJ-secret-jwt"}}"#);
        assert!(err(&bad, &[]).contains("\"other\""));
        assert!(
            err(&pod, &[("accessKeyId", "AK"), ("secretAccessKey", "S")])
                .contains("one or the other")
        );
        assert!(err(&[("authenticationSource", "node")], &[]).contains("driver or pod"));
        assert!(err(&[("stsEndpointUrl", "not a url")], &[]).contains("stsEndpointUrl"));
        // A token for EKS Pod Identity alone is enough.
        bad[5] = (
            CTX_TOKENS,
            r#"{"pods.eks.amazonaws.com":{"token":"eyJ-pi"}}"#,
        );
        let auth = spec(&bad, &[]).unwrap().pod_auth.unwrap();
        assert!(auth.sts_token.is_none() && auth.pod_identity_token.is_some());
        // A StorageClass hands the attributes on to its volumes.
        let sc =
            StorageClassParams::parse(&map(&[("bucket", "bkt"), ("authenticationSource", "pod")]))
                .unwrap();
        assert_eq!(
            sc.auth.context(),
            vec![("authenticationSource".into(), "pod".into())]
        );
    }

    #[test]
    fn publish_spec_merges_context_and_validates_flags() {
        let ctx = map(&[
            ("endpointUrl", "http://127.0.0.1:9000"),
            ("forcePathStyle", "true"),
            ("csi.storage.k8s.io/pod.name", "p"),
        ]);
        let none = HashMap::new();
        let flags = vec!["uid=1000".to_string(), "metadata-ttl=5s".to_string()];
        let spec = PublishSpec::parse(PublishInput {
            volume_id: "bkt/vol",
            volume_context: &ctx,
            publish_context: &none,
            secrets: &none,
            mount_flags: &flags,
            volume_mount_group: "2000",
            read_only: true,
            defaults: &Endpoint::default(),
        })
        .unwrap();
        assert_eq!(spec.source_arg(), "bkt:vol");
        assert_eq!(spec.config.gid, 2000);
        assert_eq!(spec.config.uid, 1000);
        // Everything that differs from the defaults (`metadata-ttl=5s` is the default), the
        // PV's options and the derived settings alike.
        let uid_flag = (nix::unistd::geteuid().as_raw() != 1000).then_some("--uid=1000");
        let expected: Vec<&str> = [
            Some("--endpoint-url=http://127.0.0.1:9000"),
            Some("--force-path-style"),
            Some("--read-only"),
            uid_flag,
            Some("--gid=2000"),
            Some("--file-mode=0664"),
            Some("--dir-mode=0775"),
            Some("--allow-other"),
        ]
        .into_iter()
        .flatten()
        .collect();
        assert_eq!(spec.mount_args(), expected);

        let bad = vec!["bogus-option=1".to_string()];
        let err = PublishSpec::parse(PublishInput {
            volume_id: "bkt",
            volume_context: &none,
            publish_context: &none,
            secrets: &none,
            mount_flags: &bad,
            volume_mount_group: "",
            read_only: false,
            defaults: &Endpoint::default(),
        })
        .unwrap_err();
        assert!(err.to_string().contains("bogus-option"), "{err}");
        let err = VolumeContext::parse(&map(&[("endpointURL", "x")])).unwrap_err();
        assert!(err.to_string().contains("endpointURL"));
    }

    #[test]
    fn storage_class_params() {
        let p =
            StorageClassParams::parse(&map(&[("bucket", "bkt"), ("basePrefix", "/k8s/")])).unwrap();
        assert_eq!(p.volume_for("pvc-1 2").unwrap().id(), "bkt/k8s/pvc-1-2");
        assert!(StorageClassParams::parse(&map(&[("basePrefix", "x")])).is_err());
        assert!(StorageClassParams::parse(&map(&[("bucket", "bkt"), ("colour", "x")])).is_err());
        assert!(sanitize_name("..").is_err());
    }
}

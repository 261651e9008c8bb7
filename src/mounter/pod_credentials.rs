//! The workload pod's own credentials (`authenticationSource: pod`). The pod's
//! service-account token is written into the mount's handoff directory, mode 0600. The
//! mounter reads it from there: a child process directly, a mounter Pod through its
//! hostPath of that directory. Variables point the AWS SDK's default chain at the file.
//! The token never appears in argv, the environment, a log line or a Kubernetes object.
//! A republish rewrites the file atomically, and the SDK reads it again when its session
//! runs out.

use std::path::Path;

/// The token's file in the mount's handoff directory.
pub const TOKEN_FILE: &str = "pod-token";

/// Where the EKS Pod Identity agent listens on every node.
pub const POD_IDENTITY_AGENT: &str = "http://169.254.170.23/v1/credentials";

/// How the token buys credentials.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TokenExchange {
    /// IRSA: STS AssumeRoleWithWebIdentity for the role annotated on the service account.
    WebIdentity {
        role_arn: String,
        /// Shows in CloudTrail: which pod the session was for.
        session_name: String,
        /// An S3-compatible store's STS; AWS's regional STS when unset.
        sts_endpoint_url: Option<String>,
    },
    /// EKS Pod Identity: the node's agent exchanges the token.
    PodIdentityAgent { url: String },
}

/// Variables the SDK reads for one of the exchanges, or a static key that would
/// take precedence over them. The process backend clears them all before it sets a
/// mount's own. The pod backend copies the set ones into the mount's Secret.
pub const VARIABLES: [&str; 7] = [
    "AWS_ROLE_ARN",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_ROLE_SESSION_NAME",
    "AWS_ENDPOINT_URL_STS",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
];

/// One workload's credentials for one mount. `Debug` never shows the token.
#[derive(Clone, PartialEq, Eq)]
pub struct PodCredentials {
    /// `namespace/service-account`.
    pub service_account: String,
    pub exchange: TokenExchange,
    token: String,
}

impl std::fmt::Debug for PodCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PodCredentials")
            .field("service_account", &self.service_account)
            .field("exchange", &self.exchange)
            .field("token", &"<redacted>")
            .finish()
    }
}

impl PodCredentials {
    pub fn new(service_account: String, exchange: TokenExchange, token: String) -> Self {
        Self {
            service_account,
            exchange,
            token,
        }
    }

    /// What publishes must agree on to share a mounter: the service account and how its
    /// token is exchanged (role, STS). Not the token itself: each pod gets its own, and
    /// the newest one serves them all.
    pub fn identity(&self) -> String {
        match &self.exchange {
            TokenExchange::WebIdentity {
                role_arn,
                sts_endpoint_url,
                ..
            } => format!(
                "{} web-identity {role_arn} {}",
                self.service_account,
                sts_endpoint_url.as_deref().unwrap_or("")
            ),
            TokenExchange::PodIdentityAgent { url } => {
                format!("{} pod-identity {url}", self.service_account)
            }
        }
    }

    /// Writes (or replaces) the token in `dir` (atomically, 0600).
    pub fn write_token(&self, dir: &Path) -> std::io::Result<()> {
        super::write_private(&dir.join(TOKEN_FILE), self.token.as_bytes())
    }

    /// Writes the token into `dir` and returns the variables that make the SDK use it.
    pub fn install(&self, dir: &Path) -> std::io::Result<Vec<(&'static str, String)>> {
        self.write_token(dir)?;
        let file = dir.join(TOKEN_FILE).to_string_lossy().into_owned();
        Ok(match &self.exchange {
            TokenExchange::WebIdentity {
                role_arn,
                session_name,
                sts_endpoint_url,
            } => {
                let mut env = vec![
                    ("AWS_ROLE_ARN", role_arn.clone()),
                    ("AWS_WEB_IDENTITY_TOKEN_FILE", file),
                    ("AWS_ROLE_SESSION_NAME", session_name.clone()),
                ];
                if let Some(url) = sts_endpoint_url {
                    env.push(("AWS_ENDPOINT_URL_STS", url.clone()));
                }
                env
            }
            TokenExchange::PodIdentityAgent { url } => vec![
                ("AWS_CONTAINER_CREDENTIALS_FULL_URI", url.clone()),
                ("AWS_CONTAINER_AUTHORIZATION_TOKEN_FILE", file),
            ],
        })
    }
}

/// An STS session name for a pod: `s3csi-<namespace>-<pod>`, in STS's alphabet
/// (`[\w+=,.@-]`) and at most 64 characters.
pub fn session_name(namespace: &str, pod: &str) -> String {
    format!("s3csi-{namespace}-{pod}")
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "_+=,.@-".contains(c) {
                c
            } else {
                '-'
            }
        })
        .take(64)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn irsa(role: &str, token: &str) -> PodCredentials {
        PodCredentials::new(
            "team-a/reader".into(),
            TokenExchange::WebIdentity {
                role_arn: role.into(),
                session_name: session_name("team-a", "reader-0"),
                sts_endpoint_url: None,
            },
            token.into(),
        )
    }

    #[test]
    fn the_token_is_a_private_file_and_never_printed() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("s3csi-podcred-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let c = irsa("arn:aws:iam::1:role/a", "eyJtoken-one");
        let env = c.install(&dir).unwrap();
        let file = dir.join(TOKEN_FILE);
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "eyJtoken-one");
        let mode = std::fs::metadata(&file).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(env.contains(&("AWS_WEB_IDENTITY_TOKEN_FILE", file.display().to_string())));
        assert!(env.iter().all(|(_, v)| !v.contains("eyJtoken")));
        assert!(!format!("{c:?}").contains("eyJtoken"));
        irsa("arn:aws:iam::1:role/a", "eyJtoken-two")
            .write_token(&dir)
            .unwrap();
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "eyJtoken-two");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_planted_link_is_replaced_not_followed() {
        let dir = std::env::temp_dir().join(format!("s3csi-podlink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let victim = dir.join("victim");
        std::fs::write(&victim, "keep me").unwrap();
        std::os::unix::fs::symlink(&victim, dir.join(TOKEN_FILE)).unwrap();
        irsa("arn:aws:iam::1:role/a", "eyJtoken")
            .write_token(&dir)
            .unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep me");
        let file = dir.join(TOKEN_FILE);
        assert!(!std::fs::symlink_metadata(&file).unwrap().is_symlink());
        assert_eq!(std::fs::read_to_string(&file).unwrap(), "eyJtoken");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn identity_is_the_account_and_role_not_the_token() {
        let a = irsa("arn:aws:iam::1:role/a", "t1");
        assert_eq!(a.identity(), irsa("arn:aws:iam::1:role/a", "t2").identity());
        assert_ne!(a.identity(), irsa("arn:aws:iam::1:role/b", "t1").identity());
    }

    #[test]
    fn session_names_fit_sts() {
        let n = session_name("ns", &"p:q/".repeat(40));
        assert!(n.len() <= 64 && n.starts_with("s3csi-ns-p-q-p-q"), "{n}");
    }
}

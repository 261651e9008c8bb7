//! `authenticationSource: pod`: which credentials the workload pod's token buys. The role
//! annotated on its service account (`eks.amazonaws.com/role-arn`, IRSA) is exchanged at
//! STS for the pod's STS-audience token; without that annotation, a token for EKS Pod
//! Identity goes to the node's Pod Identity agent. The service account is read from the
//! API server at each publish (one GET), so a changed annotation counts from the next
//! pod on.

use super::error::{CsiError, Result};
use crate::config::volume::{PodAuth, AUDIENCE_POD_IDENTITY};
use crate::mounter::pod_credentials::{session_name, TokenExchange, POD_IDENTITY_AGENT};
use crate::mounter::PodCredentials;
use k8s_openapi::api::core::v1::ServiceAccount;

pub const ROLE_ARN_ANNOTATION: &str = "eks.amazonaws.com/role-arn";

/// The API server, reached with the usual configuration (KUBECONFIG, else in-cluster) the
/// first time a volume needs it.
#[derive(Default)]
pub struct ServiceAccounts {
    client: tokio::sync::OnceCell<kube::Client>,
}

impl ServiceAccounts {
    async fn client(&self) -> Result<&kube::Client> {
        self.client
            .get_or_try_init(kube::Client::try_default)
            .await
            .map_err(|e| {
                CsiError::Unavailable(format!(
                    "authenticationSource pod needs the Kubernetes API, which is not reachable: {e}"
                ))
            })
    }

    /// The IAM role annotated on `namespace/name`, if any.
    async fn role_arn(&self, namespace: &str, name: &str) -> Result<Option<String>> {
        let api: kube::Api<ServiceAccount> =
            kube::Api::namespaced(self.client().await?.clone(), namespace);
        let sa = api.get(name).await.map_err(|e| match &e {
            // FailedPrecondition: NotFound would say the volume does not exist.
            kube::Error::Api(s) if s.code == 404 => CsiError::FailedPrecondition(format!(
                "service account {namespace}/{name} does not exist"
            )),
            kube::Error::Api(s) if s.code == 403 => CsiError::PermissionDenied(format!(
                "the node plugin may not read service account {namespace}/{name} (its \
                 ClusterRole needs get on serviceaccounts): {}",
                s.message
            )),
            _ => CsiError::Unavailable(format!(
                "cannot read service account {namespace}/{name}: {e}"
            )),
        })?;
        Ok(sa
            .metadata
            .annotations
            .and_then(|a| a.get(ROLE_ARN_ANNOTATION).cloned())
            .map(|r| r.trim().to_string())
            .filter(|r| !r.is_empty()))
    }

    /// The credentials the pod described by `auth` gets.
    pub async fn credentials(&self, auth: &PodAuth) -> Result<PodCredentials> {
        let account = format!("{}/{}", auth.namespace, auth.service_account);
        if let Some(token) = &auth.sts_token {
            if let Some(role_arn) = self
                .role_arn(&auth.namespace, &auth.service_account)
                .await?
            {
                if !role_arn.starts_with("arn:") {
                    return Err(CsiError::invalid(format!(
                        "service account {account}: {ROLE_ARN_ANNOTATION} {role_arn:?} is not an ARN"
                    )));
                }
                let exchange = TokenExchange::WebIdentity {
                    role_arn,
                    session_name: session_name(&auth.namespace, &auth.pod_name),
                    sts_endpoint_url: auth.sts_endpoint_url.clone(),
                };
                return Ok(PodCredentials::new(
                    account,
                    exchange,
                    token.secret().to_string(),
                ));
            }
        }
        if let Some(token) = &auth.pod_identity_token {
            let exchange = TokenExchange::PodIdentityAgent {
                url: POD_IDENTITY_AGENT.to_string(),
            };
            return Ok(PodCredentials::new(
                account,
                exchange,
                token.secret().to_string(),
            ));
        }
        // PodAuth has at least one token: here it had the STS one and no role.
        Err(CsiError::FailedPrecondition(format!(
            "authenticationSource is pod, but service account {account} has no \
             {ROLE_ARN_ANNOTATION} annotation (IRSA) and kubelet sent no token for \
             {AUDIENCE_POD_IDENTITY:?} (EKS Pod Identity)"
        )))
    }
}

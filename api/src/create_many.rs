//! `Sandboxes.CreateMany`: the bound on one call and the per-request result, shared by the
//! node daemon, the apiserver, the sim nodes and the SDKs.

use crate::v1::{CreateSandboxRequest, CreateSandboxResult, CreateSandboxesRequest, Sandbox};

/// Most creates one CreateMany carries.
pub const MAX_CREATES_PER_CALL: usize = 256;

/// INVALID_ARGUMENT unless `count` is 1 to [`MAX_CREATES_PER_CALL`].
pub fn check_count(count: usize) -> Result<(), tonic::Status> {
    if (1..=MAX_CREATES_PER_CALL).contains(&count) {
        Ok(())
    } else {
        Err(tonic::Status::invalid_argument(format!(
            "CreateMany carries {count} requests: give 1 to {MAX_CREATES_PER_CALL} (split larger bursts into several calls)"
        )))
    }
}

/// The requests of a CreateMany call, checked for their count.
pub fn requests(
    call: tonic::Request<CreateSandboxesRequest>,
) -> Result<Vec<CreateSandboxRequest>, tonic::Status> {
    let requests = call.into_inner().requests;
    check_count(requests.len())?;
    Ok(requests)
}

impl CreateSandboxResult {
    /// The result of one create as it goes over the wire.
    pub fn from_result(result: Result<Sandbox, tonic::Status>) -> Self {
        match result {
            Ok(sandbox) => CreateSandboxResult {
                sandbox: Some(sandbox),
                code: 0,
                message: String::new(),
            },
            Err(status) => CreateSandboxResult {
                sandbox: None,
                code: status.code() as i32,
                message: status.message().to_string(),
            },
        }
    }

    /// Back to what a lone Create would have answered.
    pub fn into_result(self) -> Result<Sandbox, tonic::Status> {
        match self.sandbox {
            Some(sandbox) if self.code == 0 => Ok(sandbox),
            _ if self.code == 0 => Err(tonic::Status::internal(
                "a CreateMany result has neither a sandbox nor an error code: the server is broken",
            )),
            _ => Err(tonic::Status::new(self.code.into(), self.message)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_outside_one_to_the_bound_are_refused() {
        assert!(check_count(0).is_err());
        assert!(check_count(1).is_ok());
        assert!(check_count(MAX_CREATES_PER_CALL).is_ok());
        let e = check_count(MAX_CREATES_PER_CALL + 1).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
    }

    #[test]
    fn results_round_trip() {
        let ok = Sandbox {
            id: "sb-n1-aaaaaaaaaaaa".into(),
            ..Default::default()
        };
        let back = CreateSandboxResult::from_result(Ok(ok.clone()))
            .into_result()
            .unwrap();
        assert_eq!(back, ok);
        let e = CreateSandboxResult::from_result(Err(tonic::Status::resource_exhausted(
            "project p is out of sandboxes quota",
        )))
        .into_result()
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert_eq!(e.message(), "project p is out of sandboxes quota");
    }
}

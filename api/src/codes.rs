//! Stable error codes carried at the start of every gRPC status message, as `[VGPU-...]`.
//!
//! Clients match on the code, people read the rest: what happened and what to do next.

/// A stable, documented error code. The string form never changes once released.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum ErrorCode {
    InvalidArgument,
    TenantNotFound,
    TenantExists,
    NodeNotFound,
    Unplaceable,
    NotLeader,
    NoLeader,
    Unavailable,
    ClusterMismatch,
    Membership,
    Storage,
    Internal,
    /// The caller's certificate (its role) does not allow the call.
    PermissionDenied,
    /// The call needs a client certificate, and none was presented.
    Unauthenticated,
    /// A bootstrap token is unknown or expired.
    TokenInvalid,
}

impl ErrorCode {
    pub const fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidArgument => "VGPU-INVALID-ARGUMENT",
            ErrorCode::TenantNotFound => "VGPU-TENANT-NOT-FOUND",
            ErrorCode::TenantExists => "VGPU-TENANT-EXISTS",
            ErrorCode::NodeNotFound => "VGPU-NODE-NOT-FOUND",
            ErrorCode::Unplaceable => "VGPU-UNPLACEABLE",
            ErrorCode::NotLeader => "VGPU-NOT-LEADER",
            ErrorCode::NoLeader => "VGPU-NO-LEADER",
            ErrorCode::Unavailable => "VGPU-UNAVAILABLE",
            ErrorCode::ClusterMismatch => "VGPU-CLUSTER-MISMATCH",
            ErrorCode::Membership => "VGPU-MEMBERSHIP",
            ErrorCode::Storage => "VGPU-STORAGE",
            ErrorCode::Internal => "VGPU-INTERNAL",
            ErrorCode::PermissionDenied => "VGPU-PERMISSION-DENIED",
            ErrorCode::Unauthenticated => "VGPU-UNAUTHENTICATED",
            ErrorCode::TokenInvalid => "VGPU-TOKEN-INVALID",
        }
    }

    /// The gRPC status code this error travels with.
    pub fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorCode::InvalidArgument => tonic::Code::InvalidArgument,
            ErrorCode::TenantNotFound | ErrorCode::NodeNotFound => tonic::Code::NotFound,
            ErrorCode::TenantExists => tonic::Code::AlreadyExists,
            ErrorCode::Unplaceable | ErrorCode::Membership => tonic::Code::FailedPrecondition,
            ErrorCode::NotLeader | ErrorCode::NoLeader | ErrorCode::Unavailable => {
                tonic::Code::Unavailable
            }
            ErrorCode::ClusterMismatch | ErrorCode::PermissionDenied => {
                tonic::Code::PermissionDenied
            }
            ErrorCode::Unauthenticated | ErrorCode::TokenInvalid => tonic::Code::Unauthenticated,
            ErrorCode::Storage | ErrorCode::Internal => tonic::Code::Internal,
        }
    }

    /// Builds a status whose message is `[CODE] message`.
    pub fn status(self, message: impl std::fmt::Display) -> tonic::Status {
        tonic::Status::new(self.grpc_code(), format!("[{}] {message}", self.as_str()))
    }

    /// Reads the code back from a status produced by [`ErrorCode::status`].
    pub fn of(status: &tonic::Status) -> Option<ErrorCode> {
        let message = status.message();
        let rest = message.strip_prefix('[')?;
        let code = &rest[..rest.find(']')?];
        ALL.iter()
            .copied()
            .find(|candidate| candidate.as_str() == code)
    }
}

const ALL: [ErrorCode; 15] = [
    ErrorCode::InvalidArgument,
    ErrorCode::TenantNotFound,
    ErrorCode::TenantExists,
    ErrorCode::NodeNotFound,
    ErrorCode::Unplaceable,
    ErrorCode::NotLeader,
    ErrorCode::NoLeader,
    ErrorCode::Unavailable,
    ErrorCode::ClusterMismatch,
    ErrorCode::Membership,
    ErrorCode::Storage,
    ErrorCode::Internal,
    ErrorCode::PermissionDenied,
    ErrorCode::Unauthenticated,
    ErrorCode::TokenInvalid,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_round_trips_through_a_status() {
        for code in ALL {
            let status = code.status("something happened");
            assert_eq!(ErrorCode::of(&status), Some(code));
            assert_eq!(status.code(), code.grpc_code());
        }
        assert_eq!(ErrorCode::of(&tonic::Status::internal("plain")), None);
    }
}

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
    /// A node's name is bound to another node key (another machine registered it first), or
    /// to a later registration with the same key (`api::metadata`).
    NodeNameTaken,
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
            ErrorCode::NodeNameTaken => "VGPU-NODE-NAME-TAKEN",
        }
    }

    /// The gRPC status code this error travels with.
    pub fn grpc_code(self) -> tonic::Code {
        match self {
            ErrorCode::InvalidArgument => tonic::Code::InvalidArgument,
            ErrorCode::TenantNotFound | ErrorCode::NodeNotFound => tonic::Code::NotFound,
            ErrorCode::TenantExists => tonic::Code::AlreadyExists,
            ErrorCode::Unplaceable | ErrorCode::Membership | ErrorCode::NodeNameTaken => {
                tonic::Code::FailedPrecondition
            }
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

    /// Builds a status whose message is `[CODE] message`. A message longer than
    /// [`STATUS_MESSAGE_BYTES_MAX`] (one that quotes a huge input) keeps its start and its end
    /// (where the advice is) and says how much was left out: gRPC carries the message in a
    /// header, and a huge one reached the client as "metadata size exceeds limit" instead.
    pub fn status(self, message: impl std::fmt::Display) -> tonic::Status {
        let message = format!("[{}] {message}", self.as_str());
        tonic::Status::new(self.grpc_code(), shorten(message))
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

/// Longest status message sent (gRPC's default header limit is 8 KiB for all headers).
pub const STATUS_MESSAGE_BYTES_MAX: usize = 2048;

/// `message` cut to at most [`STATUS_MESSAGE_BYTES_MAX`] bytes, on character boundaries.
fn shorten(message: String) -> String {
    if message.len() <= STATUS_MESSAGE_BYTES_MAX {
        return message;
    }
    let boundary_below = |mut at: usize| {
        while !message.is_char_boundary(at) {
            at -= 1;
        }
        at
    };
    let head = boundary_below(STATUS_MESSAGE_BYTES_MAX * 3 / 4);
    let mut tail = message.len() - STATUS_MESSAGE_BYTES_MAX / 5;
    while !message.is_char_boundary(tail) {
        tail += 1;
    }
    let shortened = format!(
        "{} [... {} bytes left out ...] {}",
        &message[..head],
        tail - head,
        &message[tail..]
    );
    assert!(
        shortened.len() <= STATUS_MESSAGE_BYTES_MAX,
        "a status message is bounded"
    );
    shortened
}

const ALL: [ErrorCode; 16] = [
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
    ErrorCode::NodeNameTaken,
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

    /// Issue 22: an error quoting a huge input stays a short message with its code and advice.
    #[test]
    fn a_message_quoting_a_huge_input_is_shortened() {
        let huge = "é".repeat(1 << 20);
        let status = ErrorCode::InvalidArgument.status(format!(
            "the tenant name `{huge}` is too long; use at most 63 characters"
        ));
        let message = status.message();
        assert!(
            message.len() <= STATUS_MESSAGE_BYTES_MAX,
            "{}",
            message.len()
        );
        assert!(message.starts_with("[VGPU-INVALID-ARGUMENT] the tenant name"));
        assert!(message.ends_with("use at most 63 characters"));
        assert!(message.contains("bytes left out"));
        assert_eq!(ErrorCode::of(&status), Some(ErrorCode::InvalidArgument));
        let short = ErrorCode::NoLeader.status("no leader");
        assert_eq!(short.message(), "[VGPU-NO-LEADER] no leader");
    }
}

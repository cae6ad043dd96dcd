//! Byte-size strings as people write them (`20GiB`, `512MiB`, `80GB`): the one parser and
//! formatter, which lives in the tenant contract (`tenant_abi::size`) because the interposer
//! reads sizes from its environment and must not link this crate. Re-exported here so that the
//! API's users keep one name for it.

pub use tenant_abi::size::{SizeError, format_bytes, parse_bytes};

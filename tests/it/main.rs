//! Integration tests: real processes.

//! Cross-component tests live in `it/`; this library is empty.

//! The provider stub's integration tests, one binary: its HTTP shapes in-process and the real
//! binary as a separate process.

mod binary;
mod http;

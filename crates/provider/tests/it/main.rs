//! The provider adapters' integration tests, one binary: each adapter against the provider stub or
//! a canned server on port 0.

mod http_provider;
mod push_providers;
mod real_providers;
mod stub_shapes;

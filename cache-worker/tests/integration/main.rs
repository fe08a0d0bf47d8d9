//! Integration tests: a real worker over HTTP in front of the embedded S3
//! endpoint (real SigV4 over HTTP through aws-sdk-s3); S3 requests are
//! counted, and faults injected, at the endpoint.

mod api;
mod auth;
mod cache_format;
mod conditional;
mod endpoint;
mod faults;
mod harness;
mod http_fuzz;
mod limits;
mod local;
mod plans;
mod policies;
mod power_loss;
mod power_sweep;
mod reads;
mod replicas;
mod route_matrix;
mod store_faults;
mod tenants;
mod tls;
mod wire_damage;
mod writeback;
mod writes;

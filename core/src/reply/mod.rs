//! Every answer the filter sends in place of the upstream's, and the rate-limit headers.

pub mod headers;

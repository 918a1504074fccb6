//! pvspin placeholder
#![deny(missing_docs)]

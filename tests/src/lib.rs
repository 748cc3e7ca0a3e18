
pub mod cluster;
pub mod lab;
pub mod netns;

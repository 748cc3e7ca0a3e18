
pub mod lab;
pub mod netns;

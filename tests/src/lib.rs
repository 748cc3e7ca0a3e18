
pub mod cluster;
pub mod lab;
pub mod netns;
pub mod packet;
pub mod testrun;

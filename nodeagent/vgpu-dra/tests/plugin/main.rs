//! The driver as the kubelet and the apiserver see it, in one test binary: `kubelet` plays the
//! kubelet over the driver's unix sockets; `apiserver` runs the driver's apiserver calls against
//! a small HTTP fake of the endpoints it uses.

mod apiserver;
mod kubelet;

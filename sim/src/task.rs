//! A spawned task tied to its owner's lifetime (a leaf: the server's scheduler task, the PD
//! client's connection driver).

/// Aborts the wrapped task when dropped.
pub(crate) struct AbortOnDrop(pub(crate) tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

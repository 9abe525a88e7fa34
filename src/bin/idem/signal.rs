//! Waiting for the operator to stop us.

/// Resolves on Ctrl-C, or on SIGTERM where there is one (`timeout`, a service
/// manager), and answers which of the two arrived.
pub(crate) async fn shutdown() -> std::io::Result<&'static str> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut terminate = signal(SignalKind::terminate())?;
        tokio::select! {
            interrupted = tokio::signal::ctrl_c() => interrupted.map(|()| "interrupt"),
            _ = terminate.recv() => Ok("terminate"),
        }
    }
    #[cfg(not(unix))]
    {
        tokio::signal::ctrl_c().await.map(|()| "interrupt")
    }
}

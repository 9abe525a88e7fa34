//! A TCP forwarder on 127.0.0.1 in front of a PostgreSQL port, that a test
//! can cut (a network partition) or point at another server (a failover's
//! address switch, as a managed database's endpoint moves to the promoted
//! standby).
//!
//! [`cut`](TcpForward::cut) closes every connection through it and refuses
//! new ones (each is accepted and closed at once) until
//! [`point_at`](TcpForward::point_at) names a server again; `point_at` also
//! closes every connection to the server before it, so no client keeps
//! talking to the old one.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The forwarder; it stops accepting, and closes what it carries, when dropped.
pub struct TcpForward {
    port: u16,
    /// The port connections go to (`None`: cut), and a generation that
    /// every change bumps: a connection of an older generation closes.
    target: Arc<watch::Sender<(Option<u16>, u64)>>,
    accepting: JoinHandle<()>,
}

impl TcpForward {
    /// Listens on a free port of 127.0.0.1 and forwards to `target_port` there.
    pub async fn start(target_port: u16) -> TcpForward {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the forwarder");
        let port = listener.local_addr().expect("the forwarder's address").port();
        let (target, _) = watch::channel((Some(target_port), 0u64));
        let target = Arc::new(target);
        let accepting = tokio::spawn({
            let target = target.clone();
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let mut changes = target.subscribe();
                    let (to, generation) = *changes.borrow_and_update();
                    let Some(to) = to else { continue };
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", to)).await else { return };
                        let mut inbound = inbound;
                        tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => {}
                            _ = async {
                                while changes.changed().await.is_ok() {
                                    if changes.borrow().1 != generation {
                                        return;
                                    }
                                }
                            } => {}
                        }
                    });
                }
            }
        });
        TcpForward { port, target, accepting }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// Closes every connection through the forwarder and refuses new ones.
    pub fn cut(&self) {
        self.target.send_modify(|(to, generation)| {
            *to = None;
            *generation += 1;
        });
    }

    /// Closes every connection and forwards new ones to `target_port`.
    pub fn point_at(&self, target_port: u16) {
        self.target.send_modify(|(to, generation)| {
            *to = Some(target_port);
            *generation += 1;
        });
    }
}

impl Drop for TcpForward {
    fn drop(&mut self) {
        self.cut();
        self.accepting.abort();
    }
}

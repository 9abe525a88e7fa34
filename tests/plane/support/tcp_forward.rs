//! A TCP forwarder on 127.0.0.1 in front of a server's port (PostgreSQL's,
//! or the plane's HTTP port), that a test can cut (connections closed),
//! stall (a partition: nothing gets through, and nothing is closed) or point
//! at another server (a failover's address switch, as a managed database's
//! endpoint moves to the promoted standby).
//!
//! [`cut`](TcpForward::cut) closes every connection through it and refuses
//! new ones (each is accepted and closed at once) until
//! [`point_at`](TcpForward::point_at) names a server again; `point_at` also
//! closes every connection to the server before it, so no client keeps
//! talking to the old one. [`stall`](TcpForward::stall) stops forwarding
//! bytes either way on every connection and holds them open, and accepts
//! new ones without ever forwarding them: what a worker behind a partition
//! sees, requests that never answer, until its own timeouts fire.

use std::sync::Arc;

use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// The forwarder; it stops accepting, and closes what it carries, when dropped.
pub struct TcpForward {
    port: u16,
    /// Where connections go, and a generation that every change bumps: a
    /// connection of an older generation closes, or stalls.
    target: Arc<watch::Sender<(Route, u64)>>,
    accepting: JoinHandle<()>,
}

/// Where the forwarder sends what it accepts.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Route {
    To(u16),
    Cut,
    Stall,
}

/// Holds `sockets` open, forwarding nothing, until the route changes again.
async fn stall_while<T>(changes: &mut watch::Receiver<(Route, u64)>, sockets: T) {
    let _ = changes.changed().await;
    drop(sockets);
}

impl TcpForward {
    /// Listens on a free port of 127.0.0.1 and forwards to `target_port` there.
    pub async fn start(target_port: u16) -> TcpForward {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind the forwarder");
        let port = listener.local_addr().expect("the forwarder's address").port();
        let (target, _) = watch::channel((Route::To(target_port), 0u64));
        let target = Arc::new(target);
        let accepting = tokio::spawn({
            let target = target.clone();
            async move {
                while let Ok((inbound, _)) = listener.accept().await {
                    let mut changes = target.subscribe();
                    let (route, generation) = *changes.borrow_and_update();
                    let to = match route {
                        Route::To(to) => to,
                        Route::Cut => continue,
                        Route::Stall => {
                            tokio::spawn(async move { stall_while(&mut changes, inbound).await });
                            continue;
                        }
                    };
                    tokio::spawn(async move {
                        let Ok(mut outbound) = TcpStream::connect(("127.0.0.1", to)).await else { return };
                        let mut inbound = inbound;
                        let stalled = tokio::select! {
                            _ = tokio::io::copy_bidirectional(&mut inbound, &mut outbound) => false,
                            stalled = async {
                                while changes.changed().await.is_ok() {
                                    let (route, now) = *changes.borrow_and_update();
                                    if now != generation {
                                        return route == Route::Stall;
                                    }
                                }
                                false
                            } => stalled,
                        };
                        if stalled {
                            stall_while(&mut changes, (inbound, outbound)).await;
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
        self.route(Route::Cut);
    }

    /// A partition: forwards nothing more on any connection, closes none,
    /// and holds new ones open without forwarding them, until the next
    /// [`cut`](Self::cut) or [`point_at`](Self::point_at).
    pub fn stall(&self) {
        self.route(Route::Stall);
    }

    /// Closes every connection and forwards new ones to `target_port`.
    pub fn point_at(&self, target_port: u16) {
        self.route(Route::To(target_port));
    }

    fn route(&self, route: Route) {
        self.target.send_modify(|(to, generation)| {
            *to = route;
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

//! The server's port on 127.0.0.1: bound (picked by the system, or given),
//! and held across a server restart so no other socket takes it meanwhile.

use super::error::LocalError;

/// Binds `port` (0 picks one) of 127.0.0.1 and listens. `shareable` sets
/// SO_REUSEPORT, so [`reserve_port`] can hold the port across a restart.
pub(super) fn bind_listener(port: u16, shareable: bool) -> Result<tokio::net::TcpListener, LocalError> {
    let bound = (|| {
        let socket = tokio::net::TcpSocket::new_v4()?;
        // As TcpListener::bind does: connections of an earlier server in
        // TIME_WAIT do not keep the port.
        socket.set_reuseaddr(true)?;
        if shareable {
            set_reuseport(&socket)?;
        }
        socket.bind((std::net::Ipv4Addr::LOCALHOST, port).into())?;
        socket.listen(1024)
    })();
    bound.map_err(|e| LocalError::Server(format!("binding 127.0.0.1:{port}: {e}")))
}

/// Binds `port` of 127.0.0.1 without listening, beside the server's own
/// shareable socket: while it lives no other socket can take the port, and
/// connections to it are refused once the server's socket closes. `None`
/// where SO_REUSEPORT is missing.
pub(super) fn reserve_port(port: u16) -> Result<Option<tokio::net::TcpSocket>, LocalError> {
    if !REUSEPORT {
        return Ok(None);
    }
    let reserved = (|| {
        let socket = tokio::net::TcpSocket::new_v4()?;
        // Without SO_REUSEADDR: with it, any socket that sets it too (as
        // std's and tokio's listeners do) could bind beside a socket that
        // does not listen.
        set_reuseport(&socket)?;
        socket.bind((std::net::Ipv4Addr::LOCALHOST, port).into())?;
        Ok::<_, std::io::Error>(socket)
    })();
    reserved.map(Some).map_err(|e| LocalError::Server(format!("reserving 127.0.0.1:{port}: {e}")))
}

#[cfg(all(unix, not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))))]
const REUSEPORT: bool = true;
#[cfg(not(all(
    unix,
    not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))
)))]
const REUSEPORT: bool = false;

#[cfg(all(unix, not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))))]
fn set_reuseport(socket: &tokio::net::TcpSocket) -> std::io::Result<()> {
    socket.set_reuseport(true)
}

#[cfg(not(all(
    unix,
    not(any(target_os = "solaris", target_os = "illumos", target_os = "cygwin", target_os = "nuttx"))
)))]
fn set_reuseport(_: &tokio::net::TcpSocket) -> std::io::Result<()> {
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_reserved_port_refuses_connections_and_other_binds_until_the_next_listener_takes_it() {
        if !REUSEPORT {
            return;
        }
        let first = bind_listener(0, true).expect("a picked port");
        let port = first.local_addr().expect("the address").port();
        let reserved = reserve_port(port).expect("reserved beside the listener").expect("a reservation");
        drop(first);
        // Nothing listens, and nobody else can bind it.
        let refused = tokio::net::TcpStream::connect(("127.0.0.1", port)).await;
        assert_eq!(refused.err().map(|e| e.kind()), Some(std::io::ErrorKind::ConnectionRefused));
        let taken = std::net::TcpListener::bind(("127.0.0.1", port));
        assert_eq!(taken.err().map(|e| e.kind()), Some(std::io::ErrorKind::AddrInUse));
        // The next server's listener binds it while the reservation holds.
        let next = bind_listener(port, true).expect("the same port again");
        drop(reserved);
        let accepted = tokio::join!(next.accept(), tokio::net::TcpStream::connect(("127.0.0.1", port)));
        assert!(accepted.0.is_ok() && accepted.1.is_ok(), "{accepted:?}");
    }
}

//! A loopback TCP fault proxy in Toxiproxy's vocabulary, driven in-process.
//!
//! [`FaultProxy::start`] listens on `127.0.0.1:0` and forwards every connection to
//! one upstream address. Toxics installed with [`FaultProxy::set`] disturb the bytes
//! in one direction — `Upstream` is client → server, `Downstream` server → client,
//! as Toxiproxy names its streams — and take effect on live connections too:
//!
//! | toxic | what the peer sees |
//! | --- | --- |
//! | [`Kind::Latency`] | each chunk delayed by `latency ± jitter` after it arrived |
//! | [`Kind::Bandwidth`] | bytes paced to `bytes_per_sec` |
//! | [`Kind::Slicer`] | tiny writes (`average ± variation` bytes, `delay` apart) that split SSE frames and UTF-8 |
//! | [`Kind::ResetPeer`] | a TCP RST (`SO_LINGER` 0) after N bytes or after a time |
//! | [`Kind::LimitData`] | N bytes, then the connection closes (FIN) |
//! | [`Kind::Timeout`] | a black hole: nothing passes; the connection closes after the timeout, or never for zero |
//!
//! Each toxic has a toxicity: the probability that it applies to a given
//! connection, drawn once per connection (from a seed with
//! [`FaultProxy::start_seeded`], so a run can be repeated). A reset or an error from
//! a real peer is passed on as a reset; an end of stream (FIN) as an end of stream.
//!
//! Why in-repo rather than Toxiproxy itself: no package registry this project uses
//! ships the Toxiproxy server, and the Rust port has no `reset_peer`; a test also
//! wants to flip toxics without an HTTP control plane in between.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

/// Which way the disturbed bytes flow.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Direction {
    /// Client → upstream server (the request side).
    Upstream,
    /// Upstream server → client (the response side).
    Downstream,
}

/// When a [`Kind::ResetPeer`] toxic resets the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trigger {
    /// Once this many bytes went through in the toxic's direction (0: at the first
    /// byte, before forwarding it).
    AfterBytes(u64),
    /// This long after the toxic first applied to the connection (Toxiproxy's
    /// `timeout`).
    After(Duration),
}

/// What a toxic does (Toxiproxy's toxic types).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Delays each chunk by `latency` plus a uniform draw in `[-jitter, +jitter]`,
    /// counted from when the chunk arrived (so chunks do not queue behind each
    /// other's delays).
    Latency { latency: Duration, jitter: Duration },
    /// Paces the bytes to this rate.
    Bandwidth { bytes_per_sec: u64 },
    /// Writes each chunk as pieces of `average ± variation` bytes (at least 1),
    /// `delay` apart.
    Slicer {
        average: usize,
        variation: usize,
        delay: Duration,
    },
    /// Closes the connection with a TCP RST.
    ResetPeer { after: Trigger },
    /// Lets this many bytes through, then closes the connection (FIN).
    LimitData { bytes: u64 },
    /// Swallows every byte (and the end of stream); closes the connection once
    /// `timeout` has passed since the toxic applied, or never when it is zero.
    Timeout { timeout: Duration },
}

impl Kind {
    /// The Toxiproxy type name; with the direction it names an installed toxic.
    pub fn name(&self) -> &'static str {
        match self {
            Kind::Latency { .. } => "latency",
            Kind::Bandwidth { .. } => "bandwidth",
            Kind::Slicer { .. } => "slicer",
            Kind::ResetPeer { .. } => "reset_peer",
            Kind::LimitData { .. } => "limit_data",
            Kind::Timeout { .. } => "timeout",
        }
    }
}

/// A toxic: what it does, to which direction, and how often.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Toxic {
    pub kind: Kind,
    pub direction: Direction,
    /// Probability in `[0, 1]` that the toxic applies to a connection.
    pub toxicity: f64,
}

impl Toxic {
    /// A toxic on the client → server bytes, applied to every connection.
    pub fn upstream(kind: Kind) -> Self {
        Self {
            kind,
            direction: Direction::Upstream,
            toxicity: 1.0,
        }
    }

    /// A toxic on the server → client bytes, applied to every connection.
    pub fn downstream(kind: Kind) -> Self {
        Self {
            kind,
            direction: Direction::Downstream,
            toxicity: 1.0,
        }
    }

    /// The same toxic, applied to a connection with probability `p`.
    pub fn with_toxicity(self, p: f64) -> Self {
        Self {
            toxicity: p.clamp(0.0, 1.0),
            ..self
        }
    }
}

/// A toxic as installed: the id tells connections that a replaced toxic is new
/// (and so gets a fresh toxicity draw).
#[derive(Debug, Clone, Copy)]
struct Installed {
    id: u64,
    toxic: Toxic,
}

type Toxics = Arc<Vec<Installed>>;

struct Shared {
    toxics: watch::Sender<Toxics>,
    next_id: AtomicU64,
    rng: Mutex<StdRng>,
    connections: AtomicU64,
}

impl Shared {
    fn draw(&self, toxicity: f64) -> bool {
        if toxicity >= 1.0 {
            return true;
        }
        if toxicity <= 0.0 {
            return false;
        }
        self.rng
            .lock()
            .map(|mut r| r.random::<f64>() < toxicity)
            .unwrap_or(true)
    }

    fn random_in(&self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        self.rng
            .lock()
            .map(|mut r| r.random_range(low..=high))
            .unwrap_or(low)
    }
}

/// A running fault proxy; stops accepting and closes its connections when dropped.
pub struct FaultProxy {
    /// Where clients connect (`127.0.0.1:<port>`).
    pub addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    stop: watch::Sender<bool>,
}

impl fmt::Debug for FaultProxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("FaultProxy")
            .field("addr", &self.addr)
            .field("upstream", &self.upstream)
            .field("toxics", &self.toxics())
            .finish()
    }
}

impl FaultProxy {
    /// Starts a proxy to `upstream` with no toxics (bytes pass untouched).
    pub async fn start(upstream: SocketAddr) -> io::Result<FaultProxy> {
        Self::launch(upstream, StdRng::from_os_rng()).await
    }

    /// Like [`FaultProxy::start`], with toxicity, jitter and slice sizes drawn from a
    /// seeded generator, so a run with the same seed and the same traffic repeats.
    pub async fn start_seeded(upstream: SocketAddr, seed: u64) -> io::Result<FaultProxy> {
        Self::launch(upstream, StdRng::seed_from_u64(seed)).await
    }

    async fn launch(upstream: SocketAddr, rng: StdRng) -> io::Result<FaultProxy> {
        let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0))).await?;
        let addr = listener.local_addr()?;
        let (toxics, _) = watch::channel(Toxics::default());
        let shared = Arc::new(Shared {
            toxics,
            next_id: AtomicU64::new(1),
            rng: Mutex::new(rng),
            connections: AtomicU64::new(0),
        });
        let (stop, stopped) = watch::channel(false);
        tokio::spawn(accept_loop(listener, upstream, shared.clone(), stopped));
        Ok(FaultProxy {
            addr,
            upstream,
            shared,
            stop,
        })
    }

    /// `http://127.0.0.1:<port>`, for pointing an HTTP client or a config at it.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Installs `toxic`, replacing one of the same kind on the same direction.
    pub fn set(&self, toxic: Toxic) {
        let id = self.shared.next_id.fetch_add(1, Ordering::Relaxed);
        self.shared.toxics.send_modify(|list| {
            let mut next: Vec<Installed> = list
                .iter()
                .filter(|i| {
                    i.toxic.kind.name() != toxic.kind.name() || i.toxic.direction != toxic.direction
                })
                .copied()
                .collect();
            next.push(Installed { id, toxic });
            *list = Arc::new(next);
        });
    }

    /// Removes every toxic; the bytes of live connections flow untouched again (a
    /// connection already reset or closed stays so).
    pub fn clear(&self) {
        self.shared
            .toxics
            .send_modify(|list| *list = Toxics::default());
    }

    /// The toxics installed now, in installation order.
    pub fn toxics(&self) -> Vec<Toxic> {
        self.shared
            .toxics
            .borrow()
            .iter()
            .map(|i| i.toxic)
            .collect()
    }

    /// Connections accepted so far.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        let _ = self.stop.send(true);
    }
}

async fn accept_loop(
    listener: TcpListener,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    loop {
        let accepted = tokio::select! {
            a = listener.accept() => a,
            _ = stopped.changed() => return,
        };
        let Ok((client, _)) = accepted else { continue };
        shared.connections.fetch_add(1, Ordering::SeqCst);
        tokio::spawn(connection(
            client,
            upstream,
            shared.clone(),
            stopped.clone(),
        ));
    }
}

/// How a connection is being torn down; a reset is never downgraded to a close.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Kill {
    Alive,
    Close,
    Reset,
}

/// One proxied connection's teardown state, shared by its four halves.
struct Conn {
    kill: watch::Sender<Kill>,
    /// Directions whose end of stream has been passed on; at two the connection is
    /// over.
    finished: AtomicU8,
}

impl Conn {
    fn kill(&self, how: Kill) {
        self.kill.send_if_modified(|k| {
            if how > *k {
                *k = how;
                true
            } else {
                false
            }
        });
    }

    fn direction_finished(&self) {
        if self.finished.fetch_add(1, Ordering::SeqCst) + 1 >= 2 {
            self.kill(Kill::Close);
        }
    }
}

async fn connection(
    client: TcpStream,
    upstream: SocketAddr,
    shared: Arc<Shared>,
    mut stopped: watch::Receiver<bool>,
) {
    let server = tokio::select! {
        s = TcpStream::connect(upstream) => s,
        _ = stopped.changed() => return,
    };
    let Ok(server) = server else {
        // The upstream is down: the client sees its connection refused as a reset.
        let _ = client.set_zero_linger();
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let conn = Arc::new(Conn {
        kill: watch::channel(Kill::Alive).0,
        finished: AtomicU8::new(0),
    });
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pipe(
        Direction::Upstream,
        client_read,
        server_write,
        shared.clone(),
        conn.clone(),
    );
    let down = pipe(
        Direction::Downstream,
        server_read,
        client_write,
        shared,
        conn.clone(),
    );
    let stop = async move {
        let _ = stopped.wait_for(|s| *s).await;
        conn.kill(Kill::Close);
        std::future::pending::<()>().await;
    };
    tokio::select! {
        _ = async { tokio::join!(up, down) } => {}
        () = stop => {}
    }
}

/// What the reader hands the writer.
enum Chunk {
    Data { arrived: Instant, bytes: Bytes },
    Eof,
}

/// One direction: a reader that timestamps chunks as they arrive, and a writer that
/// applies the toxics to them. Bounded in between, so a throttled writer slows the
/// sender through TCP flow control instead of buffering without limit.
async fn pipe(
    direction: Direction,
    from: OwnedReadHalf,
    to: OwnedWriteHalf,
    shared: Arc<Shared>,
    conn: Arc<Conn>,
) {
    let (tx, rx) = mpsc::channel(16);
    tokio::join!(
        reader(from, tx, &conn),
        writer(direction, rx, to, &shared, &conn),
    );
}

/// Waits until the connection is being torn down, and says how.
async fn torn_down(killed: &mut watch::Receiver<Kill>) -> Kill {
    match killed.wait_for(|k| *k != Kill::Alive).await {
        Ok(how) => *how,
        Err(_) => Kill::Close,
    }
}

async fn reader(mut from: OwnedReadHalf, tx: mpsc::Sender<Chunk>, conn: &Conn) {
    let mut killed = conn.kill.subscribe();
    let mut buf = vec![0u8; 16 * 1024];
    let how = loop {
        let read = tokio::select! {
            r = from.read(&mut buf) => r,
            how = torn_down(&mut killed) => break how,
        };
        match read {
            Ok(0) => {
                let _ = tx.send(Chunk::Eof).await;
                // Wait for the connection's end: dropping the read half early would
                // make the kernel answer the peer's later bytes with a reset.
                break torn_down(&mut killed).await;
            }
            Ok(n) => {
                let chunk = Chunk::Data {
                    arrived: Instant::now(),
                    bytes: Bytes::copy_from_slice(&buf[..n]),
                };
                let sent = tokio::select! {
                    s = tx.send(chunk) => s.is_ok(),
                    how = torn_down(&mut killed) => break how,
                };
                if !sent {
                    break torn_down(&mut killed).await;
                }
            }
            Err(_) => {
                // The real peer reset (or the socket failed): pass it on as a reset.
                conn.kill(Kill::Reset);
                break Kill::Reset;
            }
        }
    };
    if how == Kill::Reset {
        let _ = from.as_ref().set_zero_linger();
    }
}

/// Per-connection, per-direction state of the toxics.
struct Link {
    direction: Direction,
    /// Whether each toxic (by id) applies to this connection, and since when.
    applies: HashMap<u64, Option<Instant>>,
    /// Bytes forwarded in this direction.
    forwarded: u64,
    /// The sender's end of stream has arrived.
    eof: bool,
    /// ... and has been passed on.
    finished: bool,
}

impl Link {
    /// The toxics of this direction that apply to this connection, deciding the
    /// toxicity of new ones.
    fn active(&mut self, shared: &Shared, all: &[Installed]) -> Vec<(Installed, Instant)> {
        let mut out = Vec::new();
        for i in all.iter().filter(|i| i.toxic.direction == self.direction) {
            let since = *self
                .applies
                .entry(i.id)
                .or_insert_with(|| shared.draw(i.toxic.toxicity).then(Instant::now));
            if let Some(since) = since {
                out.push((*i, since));
            }
        }
        out
    }
}

/// What a timer or a cut-off does to the connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    Close,
    Reset,
}

async fn writer(
    direction: Direction,
    mut rx: mpsc::Receiver<Chunk>,
    mut to: OwnedWriteHalf,
    shared: &Shared,
    conn: &Conn,
) {
    let mut killed = conn.kill.subscribe();
    let mut toxics = shared.toxics.subscribe();
    let mut link = Link {
        direction,
        applies: HashMap::new(),
        forwarded: 0,
        eof: false,
        finished: false,
    };
    let ending = loop {
        let all = toxics.borrow_and_update().clone();
        let active = link.active(shared, &all);
        let black_hole = active
            .iter()
            .any(|(i, _)| matches!(i.toxic.kind, Kind::Timeout { .. }));
        if link.eof && !link.finished && !black_hole {
            link.finished = true;
            let _ = to.shutdown().await;
            conn.direction_finished();
        }
        let deadline = timer(&active);
        tokio::select! {
            _ = torn_down(&mut killed) => break None,
            _ = toxics.changed() => {}
            () = sleep_until(deadline.map(|(at, _)| at)) => break deadline.map(|(_, e)| e),
            chunk = rx.recv(), if !link.eof => match chunk {
                Some(Chunk::Data { arrived, bytes }) => {
                    let delivered = tokio::select! {
                        r = deliver(&mut link, shared, &active, &mut to, arrived, bytes) => r,
                        _ = torn_down(&mut killed) => break None,
                        () = sleep_until(deadline.map(|(at, _)| at)) => {
                            break deadline.map(|(_, e)| e);
                        }
                    };
                    match delivered {
                        Ok(None) => {}
                        Ok(Some(ending)) => break Some(ending),
                        // The receiving peer is gone: pass that on as a reset.
                        Err(_) => break Some(Ending::Reset),
                    }
                }
                Some(Chunk::Eof) | None => link.eof = true,
            },
        }
    };
    match ending {
        Some(Ending::Close) => conn.kill(Kill::Close),
        Some(Ending::Reset) => conn.kill(Kill::Reset),
        None => {}
    }
    if torn_down(&mut killed).await == Kill::Reset {
        let _ = to.as_ref().set_zero_linger();
        // Dropping the write half would send a FIN first; the reset must come alone.
        to.forget();
    }
}

/// The earliest timed ending among the active toxics.
fn timer(active: &[(Installed, Instant)]) -> Option<(Instant, Ending)> {
    active
        .iter()
        .filter_map(|(i, since)| match i.toxic.kind {
            Kind::ResetPeer {
                after: Trigger::After(d),
            } => Some((*since + d, Ending::Reset)),
            Kind::Timeout { timeout } if !timeout.is_zero() => {
                Some((*since + timeout, Ending::Close))
            }
            _ => None,
        })
        .min_by_key(|(at, _)| *at)
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}

/// Forwards one chunk through the toxics; `Some(ending)` when a cut-off toxic ends
/// the connection after it.
async fn deliver(
    link: &mut Link,
    shared: &Shared,
    active: &[(Installed, Instant)],
    to: &mut OwnedWriteHalf,
    arrived: Instant,
    mut bytes: Bytes,
) -> io::Result<Option<Ending>> {
    let kinds: Vec<Kind> = active.iter().map(|(i, _)| i.toxic.kind).collect();
    if kinds.iter().any(|k| matches!(k, Kind::Timeout { .. })) {
        return Ok(None);
    }
    // The tightest cut-off wins: forward up to it, then end the connection.
    let cutoff = kinds
        .iter()
        .filter_map(|k| match k {
            Kind::ResetPeer {
                after: Trigger::AfterBytes(n),
            } => Some((*n, Ending::Reset)),
            Kind::LimitData { bytes } => Some((*bytes, Ending::Close)),
            _ => None,
        })
        .min_by_key(|(n, _)| *n);
    let mut ending = None;
    if let Some((limit, how)) = cutoff {
        let room = limit.saturating_sub(link.forwarded);
        if (bytes.len() as u64) >= room {
            bytes.truncate(usize::try_from(room).unwrap_or(usize::MAX));
            ending = Some(how);
        }
    }
    for k in &kinds {
        if let Kind::Latency { latency, jitter } = *k {
            let jitter_us = u64::try_from(jitter.as_micros()).unwrap_or(u64::MAX);
            let base_us = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
            let us = shared.random_in(
                base_us.saturating_sub(jitter_us),
                base_us.saturating_add(jitter_us),
            );
            tokio::time::sleep_until(arrived + Duration::from_micros(us)).await;
        }
    }
    let slicer = kinds.iter().find_map(|k| match *k {
        Kind::Slicer {
            average,
            variation,
            delay,
        } => Some((average, variation, delay)),
        _ => None,
    });
    let rate = kinds.iter().find_map(|k| match *k {
        Kind::Bandwidth { bytes_per_sec } => Some(bytes_per_sec.max(1)),
        _ => None,
    });
    let pieces = match (slicer, rate) {
        (Some((average, variation, _)), _) => slice(&bytes, average, variation, |lo, hi| {
            shared.random_in(lo, hi)
        }),
        // Pieces worth ~10 ms each keep the pacing smooth.
        (None, Some(rate)) => {
            let size = usize::try_from(rate / 100).unwrap_or(usize::MAX).max(1);
            slice(&bytes, size, 0, |lo, _| lo)
        }
        (None, None) => vec![bytes.clone()],
    };
    let count = pieces.len();
    for (n, piece) in pieces.into_iter().enumerate() {
        to.write_all(&piece).await?;
        link.forwarded += piece.len() as u64;
        if let Some(rate) = rate {
            let us = (piece.len() as u64).saturating_mul(1_000_000) / rate;
            tokio::time::sleep(Duration::from_micros(us)).await;
        }
        if let Some((_, _, delay)) = slicer
            && n + 1 < count
            && !delay.is_zero()
        {
            tokio::time::sleep(delay).await;
        }
    }
    Ok(ending)
}

/// Splits `bytes` into pieces of `average ± variation` bytes (at least 1), with
/// `draw(low, high)` picking each size in `[low, high]`.
fn slice(
    bytes: &Bytes,
    average: usize,
    variation: usize,
    draw: impl Fn(u64, u64) -> u64,
) -> Vec<Bytes> {
    let low = average.saturating_sub(variation).max(1) as u64;
    let high = (average.saturating_add(variation) as u64).max(low);
    let mut out = Vec::new();
    let mut rest = bytes.clone();
    while !rest.is_empty() {
        let size = usize::try_from(draw(low, high))
            .unwrap_or(usize::MAX)
            .clamp(1, rest.len());
        out.push(rest.split_to(size));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::time::Instant as StdInstant;

    use super::*;

    /// An echo server that records how many bytes each connection sent it.
    struct Echo {
        addr: SocketAddr,
        received: Arc<Mutex<Vec<u64>>>,
    }

    impl Echo {
        async fn start() -> Echo {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let received = Arc::new(Mutex::new(Vec::new()));
            let log = received.clone();
            tokio::spawn(async move {
                while let Ok((mut s, _)) = listener.accept().await {
                    let log = log.clone();
                    tokio::spawn(async move {
                        let mut buf = [0u8; 4096];
                        let mut total = 0u64;
                        loop {
                            match s.read(&mut buf).await {
                                Ok(0) | Err(_) => break,
                                Ok(n) => {
                                    total += n as u64;
                                    if s.write_all(&buf[..n]).await.is_err() {
                                        break;
                                    }
                                }
                            }
                        }
                        let _ = s.shutdown().await;
                        log.lock().unwrap().push(total);
                    });
                }
            });
            Echo { addr, received }
        }

        /// Waits (bounded) until `n` connections have ended; their byte counts.
        async fn totals(&self, n: usize) -> Vec<u64> {
            let deadline = StdInstant::now() + Duration::from_secs(5);
            loop {
                let got = self.received.lock().unwrap().clone();
                if got.len() >= n || StdInstant::now() > deadline {
                    return got;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
    }

    /// Reads until the end of stream or an error (bounded by 5 s); the bytes, each
    /// read's size, and how it ended.
    async fn read_to_end(s: &mut TcpStream) -> (Vec<u8>, Vec<usize>, io::Result<()>) {
        let mut out = Vec::new();
        let mut reads = Vec::new();
        let mut buf = [0u8; 4096];
        let ended = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(n) => {
                        out.extend_from_slice(&buf[..n]);
                        reads.push(n);
                    }
                    Err(e) => return Err(e),
                }
            }
        })
        .await
        .unwrap_or_else(|_| Err(io::Error::new(io::ErrorKind::TimedOut, "no end in 5 s")));
        (out, reads, ended)
    }

    async fn read_exactly(s: &mut TcpStream, n: usize) -> Vec<u8> {
        let mut buf = vec![0u8; n];
        tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf))
            .await
            .expect("bytes within 5 s")
            .expect("read");
        buf
    }

    async fn setup(toxic: Option<Toxic>) -> (Echo, FaultProxy, TcpStream) {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await.unwrap();
        if let Some(t) = toxic {
            proxy.set(t);
        }
        let client = TcpStream::connect(proxy.addr).await.unwrap();
        (echo, proxy, client)
    }

    fn payload(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i % 251) as u8).collect()
    }

    #[tokio::test]
    async fn without_toxics_bytes_and_the_end_of_stream_pass_untouched() {
        let (echo, proxy, mut client) = setup(None).await;
        let data = payload(200_000);
        let (mut r, mut w) = client.split();
        let (got, ()) = tokio::join!(
            async {
                let mut got = Vec::new();
                tokio::time::timeout(Duration::from_secs(5), r.read_to_end(&mut got))
                    .await
                    .unwrap()
                    .unwrap();
                got
            },
            async {
                w.write_all(&data).await.unwrap();
                w.shutdown().await.unwrap();
            }
        );
        assert_eq!(got, data);
        assert_eq!(echo.totals(1).await, [200_000]);
        assert_eq!(proxy.connections(), 1);
    }

    #[tokio::test]
    async fn latency_delays_each_chunk_from_its_arrival() {
        let latency = Duration::from_millis(150);
        let (_echo, _proxy, mut client) = setup(Some(Toxic::downstream(Kind::Latency {
            latency,
            jitter: Duration::ZERO,
        })))
        .await;
        let started = StdInstant::now();
        client.write_all(b"one").await.unwrap();
        assert_eq!(read_exactly(&mut client, 3).await, b"one");
        let first = started.elapsed();
        assert!(first >= latency, "first chunk after {first:?}");
        // Two chunks sent back to back arrive one latency later, not two.
        let started = StdInstant::now();
        client.write_all(b"two").await.unwrap();
        tokio::time::sleep(Duration::from_millis(20)).await;
        client.write_all(b"three").await.unwrap();
        assert_eq!(read_exactly(&mut client, 8).await, b"twothree");
        let both = started.elapsed();
        assert!(both >= latency + Duration::from_millis(20), "{both:?}");
        assert!(
            both < latency * 2,
            "chunks queued behind each other: {both:?}"
        );
    }

    #[tokio::test]
    async fn bandwidth_paces_the_bytes() {
        let (_echo, _proxy, mut client) = setup(Some(Toxic::downstream(Kind::Bandwidth {
            bytes_per_sec: 20_000,
        })))
        .await;
        let data = payload(4_000);
        let started = StdInstant::now();
        client.write_all(&data).await.unwrap();
        assert_eq!(read_exactly(&mut client, data.len()).await, data);
        let took = started.elapsed();
        // 4 000 bytes at 20 000 B/s: 200 ms (the last piece's pause may not be waited).
        assert!(took >= Duration::from_millis(180), "{took:?}");
    }

    #[tokio::test]
    async fn slicer_splits_frames_into_tiny_writes_and_keeps_every_byte() {
        let (_echo, _proxy, mut client) = setup(Some(Toxic::downstream(Kind::Slicer {
            average: 2,
            variation: 1,
            delay: Duration::from_millis(3),
        })))
        .await;
        let frame = "data: {\"text\":\"é€😀\"}\r\n\r\n".as_bytes();
        client.write_all(frame).await.unwrap();
        client.shutdown().await.unwrap();
        let (got, reads, ended) = read_to_end(&mut client).await;
        assert!(ended.is_ok(), "{ended:?}");
        assert_eq!(got, frame);
        // 27 bytes in pieces of 1-3 bytes, 3 ms apart: the reader sees many reads.
        assert!(reads.len() >= 3, "reads {reads:?}");
    }

    #[test]
    fn slices_stay_within_their_bounds_and_cover_the_chunk() {
        let bytes = Bytes::from(payload(1_000));
        let rng = Mutex::new(StdRng::seed_from_u64(7));
        let pieces = slice(&bytes, 3, 2, |lo, hi| {
            rng.lock().unwrap().random_range(lo..=hi)
        });
        assert!(pieces.iter().all(|p| (1..=5).contains(&p.len())));
        assert!(
            pieces.iter().any(|p| p.len() != pieces[0].len()),
            "sizes vary"
        );
        assert_eq!(pieces.concat(), bytes.to_vec());
        // A zero average still makes progress one byte at a time.
        assert_eq!(
            slice(&Bytes::from_static(b"abc"), 0, 0, |lo, _| lo).len(),
            3
        );
    }

    #[tokio::test]
    async fn reset_peer_after_bytes_sends_a_reset_not_a_fin() {
        let (_echo, _proxy, mut client) = setup(Some(Toxic::downstream(Kind::ResetPeer {
            after: Trigger::AfterBytes(10),
        })))
        .await;
        client.write_all(&payload(100)).await.unwrap();
        let (got, _, ended) = read_to_end(&mut client).await;
        assert!(got.len() <= 10, "{} bytes", got.len());
        assert_eq!(got, payload(100)[..got.len()]);
        let kind = ended.expect_err("a reset, not a clean end").kind();
        assert_eq!(kind, io::ErrorKind::ConnectionReset);
    }

    #[tokio::test]
    async fn reset_peer_after_a_time_resets_an_idle_connection() {
        let after = Duration::from_millis(100);
        let (_echo, _proxy, mut client) = setup(Some(Toxic::downstream(Kind::ResetPeer {
            after: Trigger::After(after),
        })))
        .await;
        let started = StdInstant::now();
        let (got, _, ended) = read_to_end(&mut client).await;
        assert!(got.is_empty());
        assert_eq!(
            ended.expect_err("a reset").kind(),
            io::ErrorKind::ConnectionReset
        );
        assert!(started.elapsed() >= after - Duration::from_millis(5));
    }

    #[tokio::test]
    async fn limit_data_closes_cleanly_after_n_bytes() {
        let (_echo, _proxy, mut client) =
            setup(Some(Toxic::downstream(Kind::LimitData { bytes: 10 }))).await;
        client.write_all(&payload(100)).await.unwrap();
        let (got, _, ended) = read_to_end(&mut client).await;
        assert!(ended.is_ok(), "a clean end of stream: {ended:?}");
        assert_eq!(got, payload(100)[..10]);
    }

    #[tokio::test]
    async fn limit_data_upstream_caps_what_the_server_receives() {
        let (echo, _proxy, mut client) =
            setup(Some(Toxic::upstream(Kind::LimitData { bytes: 10 }))).await;
        client.write_all(&payload(100)).await.unwrap();
        let (got, _, _) = read_to_end(&mut client).await;
        assert!(got.len() <= 10);
        assert_eq!(echo.totals(1).await, [10]);
    }

    #[tokio::test]
    async fn timeout_swallows_everything_then_closes() {
        let timeout = Duration::from_millis(150);
        let (_echo, _proxy, mut client) =
            setup(Some(Toxic::downstream(Kind::Timeout { timeout }))).await;
        let started = StdInstant::now();
        client.write_all(b"hello?").await.unwrap();
        let (got, _, ended) = read_to_end(&mut client).await;
        assert!(got.is_empty(), "nothing passes a black hole");
        assert!(ended.is_ok(), "closed, not reset: {ended:?}");
        assert!(started.elapsed() >= timeout - Duration::from_millis(5));
    }

    #[tokio::test]
    async fn timeout_zero_holds_the_connection_until_cleared() {
        let (_echo, proxy, mut client) = setup(Some(Toxic::downstream(Kind::Timeout {
            timeout: Duration::ZERO,
        })))
        .await;
        client.write_all(b"lost").await.unwrap();
        let mut buf = [0u8; 16];
        let held = tokio::time::timeout(Duration::from_millis(300), client.read(&mut buf)).await;
        assert!(
            held.is_err(),
            "no byte and no end while black-holed: {held:?}"
        );
        proxy.clear();
        client.write_all(b"found").await.unwrap();
        assert_eq!(read_exactly(&mut client, 5).await, b"found");
    }

    #[tokio::test]
    async fn toxicity_is_drawn_once_per_connection() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start_seeded(echo.addr, 42).await.unwrap();
        proxy.set(Toxic::downstream(Kind::LimitData { bytes: 0 }).with_toxicity(0.5));
        let mut cut = 0;
        for _ in 0..20 {
            let mut c = TcpStream::connect(proxy.addr).await.unwrap();
            c.write_all(b"x").await.unwrap();
            c.shutdown().await.unwrap();
            let (got, _, ended) = read_to_end(&mut c).await;
            assert!(ended.is_ok(), "{ended:?}");
            if got.is_empty() {
                cut += 1;
            } else {
                assert_eq!(got, b"x");
            }
        }
        assert!((1..20).contains(&cut), "cut {cut} of 20");
        proxy.set(Toxic::downstream(Kind::LimitData { bytes: 0 }).with_toxicity(0.0));
        let mut c = TcpStream::connect(proxy.addr).await.unwrap();
        c.write_all(b"y").await.unwrap();
        assert_eq!(read_exactly(&mut c, 1).await, b"y");
    }

    #[tokio::test]
    async fn an_unreachable_upstream_is_a_reset() {
        let closed = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap()
        };
        let proxy = FaultProxy::start(closed).await.unwrap();
        let mut c = TcpStream::connect(proxy.addr).await.unwrap();
        let (got, _, ended) = read_to_end(&mut c).await;
        assert!(got.is_empty());
        assert_eq!(
            ended.expect_err("a reset").kind(),
            io::ErrorKind::ConnectionReset
        );
    }

    #[tokio::test]
    async fn set_replaces_the_same_kind_on_the_same_direction() {
        let echo = Echo::start().await;
        let proxy = FaultProxy::start(echo.addr).await.unwrap();
        let slow = |ms| Kind::Latency {
            latency: Duration::from_millis(ms),
            jitter: Duration::ZERO,
        };
        proxy.set(Toxic::downstream(slow(10)));
        proxy.set(Toxic::downstream(slow(20)));
        proxy.set(Toxic::upstream(slow(30)));
        proxy.set(Toxic::downstream(Kind::LimitData { bytes: 5 }));
        assert_eq!(
            proxy.toxics(),
            [
                Toxic::downstream(slow(20)),
                Toxic::upstream(slow(30)),
                Toxic::downstream(Kind::LimitData { bytes: 5 }),
            ]
        );
        proxy.clear();
        assert!(proxy.toxics().is_empty());
    }
}

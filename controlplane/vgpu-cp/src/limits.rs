//! Rate limits of one member, sans-IO (callers pass `now`): a [`TokenBucket`], and
//! [`PerKey`] buckets for the writes of each tenant owner and for the linearizable reads that
//! unauthenticated `JoinNode` calls may cost; [`PeerConnections`], the connections each peer
//! address may hold open at once; and [`Anonymous`], how long a connection may stay open without
//! showing a client certificate.
//!
//! A limit is per member, not per cluster: a caller that spreads its calls over every member
//! gets each member's rate. That still bounds what one caller costs the leader to a small
//! multiple of one rate, which is what they are for (issue 22: 150-200 writes a second from one
//! tenant starved its node's heartbeats; 433 unauthenticated joins a second each cost a
//! linearizable read).

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Writes a second one tenant owner may make through one member, and the burst it may save up.
pub const OWNER_WRITES_PER_SECOND: u32 = 50;
pub const OWNER_WRITES_BURST: u32 = 100;
/// Linearizable reads a second that `JoinNode` calls with an unknown token may cost one member.
pub const JOIN_READS_PER_SECOND: u32 = 20;
pub const JOIN_READS_BURST: u32 = 40;
/// Most keys [`PerKey`] remembers; past it, the keys whose buckets are full are forgotten (they
/// are as good as new), and if none is, the caller is refused until some refill.
pub const KEYS_MAX: usize = 4096;

/// A token bucket: `rate` tokens a second, at most `burst` saved.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    rate: u32,
    burst: u32,
    tokens: f64,
    at: Instant,
}

impl TokenBucket {
    pub fn new(rate: u32, burst: u32, now: Instant) -> TokenBucket {
        assert!(
            rate > 0 && burst > 0,
            "a bucket refills and holds something"
        );
        TokenBucket {
            rate,
            burst,
            tokens: f64::from(burst),
            at: now,
        }
    }

    fn refill(&mut self, now: Instant) {
        let elapsed = now.saturating_duration_since(self.at).as_secs_f64();
        self.tokens = (self.tokens + elapsed * f64::from(self.rate)).min(f64::from(self.burst));
        self.at = self.at.max(now);
    }

    /// Takes one token at `now`; `Err` says how long until one is there.
    pub fn take(&mut self, now: Instant) -> Result<(), Duration> {
        self.refill(now);
        if self.tokens >= 1.0 {
            self.tokens -= 1.0;
            debug_assert!(self.tokens >= 0.0);
            return Ok(());
        }
        let missing = 1.0 - self.tokens;
        Err(Duration::from_secs_f64(missing / f64::from(self.rate)))
    }

    fn is_full(&mut self, now: Instant) -> bool {
        self.refill(now);
        self.tokens >= f64::from(self.burst)
    }
}

/// One [`TokenBucket`] per key (a tenant owner), at most [`KEYS_MAX`] keys.
#[derive(Debug)]
pub struct PerKey {
    rate: u32,
    burst: u32,
    buckets: HashMap<String, TokenBucket>,
}

impl PerKey {
    pub fn new(rate: u32, burst: u32) -> PerKey {
        PerKey {
            rate,
            burst,
            buckets: HashMap::new(),
        }
    }

    /// Takes one token of `key`'s bucket at `now`; `Err` says how long until one is there.
    pub fn take(&mut self, key: &str, now: Instant) -> Result<(), Duration> {
        if !self.buckets.contains_key(key) && self.buckets.len() >= KEYS_MAX {
            self.buckets.retain(|_, bucket| !bucket.is_full(now));
            if self.buckets.len() >= KEYS_MAX {
                return Err(Duration::from_secs(1));
            }
        }
        let (rate, burst) = (self.rate, self.burst);
        let bucket = self
            .buckets
            .entry(key.to_owned())
            .or_insert_with(|| TokenBucket::new(rate, burst, now));
        let taken = bucket.take(now);
        assert!(self.buckets.len() <= KEYS_MAX, "keys are bounded");
        taken
    }
}

/// Connections one peer address may hold open at one member at once (issue 22: 600 idle TLS
/// connections without a certificate, from one address, used up a member's descriptors). A
/// vgpuctl call, an agent or a member uses one or two; a simulated fleet one per 50 nodes.
pub const CONNECTIONS_PER_PEER_MAX: usize = 256;

/// Connections refused because their peer already held [`CONNECTIONS_PER_PEER_MAX`], for
/// `/metrics`.
pub static CONNECTIONS_REFUSED: AtomicU64 = AtomicU64::new(0);

/// How long a connection may stay open under mTLS before a request on it has shown a client
/// certificate (issue 22: idle TLS connections without a certificate were never closed). What
/// needs no certificate is one call each (`JoinNode` with a bootstrap token, `/healthz`), so a
/// minute is ample; a client that keeps such a connection gets a new one.
pub const ANONYMOUS_CONNECTION_MAX: Duration = Duration::from_secs(60);
/// Connections remembered as authenticated at once (open connections: bounded by descriptors;
/// past it a connection is treated as anonymous, which costs it only a reconnection).
const AUTHENTICATED_MAX: usize = 65_536;

/// Closed by [`Anonymous`], for `/metrics`.
pub static ANONYMOUS_CONNECTIONS_CLOSED: AtomicU64 = AtomicU64::new(0);
/// Requests without a client certificate that one connection may have in flight at once under
/// mTLS. What needs no certificate is one small call at a time (`JoinNode`, `/healthz`); without
/// this bound one such connection could hold `lib::STREAMS_PER_CONNECTION_MAX` half-sent
/// requests of up to 4 MiB each (issue 22: a member grew to 1.93 GB under half-open requests).
pub const ANONYMOUS_REQUESTS_PER_CONNECTION_MAX: u32 = 4;
/// Largest body of a request without a client certificate under mTLS: a `JoinNode` request (a
/// token, a node name and a public key) is a few hundred bytes; the bound leaves room for growth.
pub const ANONYMOUS_REQUEST_BYTES_MAX: usize = 64 << 10;
/// Requests without a client certificate refused because their connection had
/// [`ANONYMOUS_REQUESTS_PER_CONNECTION_MAX`] in flight, for `/metrics`.
pub static ANONYMOUS_REQUESTS_REFUSED: AtomicU64 = AtomicU64::new(0);

/// The connections on which a request showed a client certificate, by peer address and port
/// (unique among open connections): the others are closed [`Anonymous::max`] after they were
/// accepted. Marked by the request path, read and forgotten by the connection.
#[derive(Debug)]
pub struct Anonymous {
    max: Duration,
    authenticated: Mutex<HashSet<SocketAddr>>,
    /// Requests without a certificate in flight, by connection (only connections with one).
    in_flight: Mutex<HashMap<SocketAddr, u32>>,
}

/// One request without a client certificate in flight on its connection; dropping it (the
/// request answered or abandoned) frees its place.
#[derive(Debug)]
pub struct AnonymousRequest {
    anonymous: Arc<Anonymous>,
    peer: SocketAddr,
}

impl Drop for AnonymousRequest {
    fn drop(&mut self) {
        let mut in_flight = self.anonymous.in_flight.lock().expect("anonymous lock");
        if let Some(count) = in_flight.get_mut(&self.peer) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                in_flight.remove(&self.peer);
            }
        }
    }
}

impl Anonymous {
    pub fn new(max: Duration) -> Arc<Anonymous> {
        Arc::new(Anonymous {
            max,
            authenticated: Mutex::default(),
            in_flight: Mutex::default(),
        })
    }

    /// Admits one more request without a client certificate on the connection from `peer`, or
    /// `None` when it has [`ANONYMOUS_REQUESTS_PER_CONNECTION_MAX`] in flight (counted in
    /// [`ANONYMOUS_REQUESTS_REFUSED`]). The map holds only connections with a request in flight,
    /// so it is bounded by the member's connections times that bound.
    pub fn admit_request(self: &Arc<Self>, peer: SocketAddr) -> Option<AnonymousRequest> {
        let mut in_flight = self.in_flight.lock().expect("anonymous lock");
        let count = in_flight.entry(peer).or_insert(0);
        if *count >= ANONYMOUS_REQUESTS_PER_CONNECTION_MAX {
            ANONYMOUS_REQUESTS_REFUSED.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *count += 1;
        Some(AnonymousRequest {
            anonymous: self.clone(),
            peer,
        })
    }

    /// Requests without a certificate in flight on the connection from `peer`.
    pub fn requests_in_flight(&self, peer: SocketAddr) -> u32 {
        let in_flight = self.in_flight.lock().expect("anonymous lock");
        in_flight.get(&peer).copied().unwrap_or(0)
    }

    pub fn max(&self) -> Duration {
        self.max
    }

    /// A request on the connection from `peer` carried a client certificate.
    pub fn authenticated(&self, peer: SocketAddr) {
        let mut authenticated = self.authenticated.lock().expect("anonymous lock");
        if authenticated.len() < AUTHENTICATED_MAX {
            authenticated.insert(peer);
        }
    }

    pub fn is_authenticated(&self, peer: SocketAddr) -> bool {
        self.authenticated
            .lock()
            .expect("anonymous lock")
            .contains(&peer)
    }

    /// Whether the connection from `peer`, accepted at `accepted`, must be closed at `now`.
    pub fn expired(&self, peer: SocketAddr, accepted: Instant, now: Instant) -> bool {
        now.saturating_duration_since(accepted) >= self.max && !self.is_authenticated(peer)
    }

    /// The connection from `peer` closed.
    pub fn forget(&self, peer: SocketAddr) {
        self.authenticated
            .lock()
            .expect("anonymous lock")
            .remove(&peer);
    }
}

/// The open connections of each peer address. Loopback peers are not counted: a process on the
/// member's own host can use up its descriptors whatever the member does, and the test clusters
/// and simulated fleets all run there. The map holds only peers with an open connection, so it
/// is bounded by the member's descriptors.
#[derive(Debug)]
pub struct PeerConnections {
    per_peer_max: usize,
    open: Mutex<HashMap<IpAddr, usize>>,
}

/// One admitted connection; dropping it (the connection closed) frees its place.
#[derive(Debug)]
pub struct ConnectionPermit {
    connections: Arc<PeerConnections>,
    peer: Option<IpAddr>,
}

impl PeerConnections {
    pub fn new(per_peer_max: usize) -> Arc<PeerConnections> {
        assert!(per_peer_max > 0, "a peer may hold some connection");
        Arc::new(PeerConnections {
            per_peer_max,
            open: Mutex::default(),
        })
    }

    /// Admits one more connection of `peer`, or `None` when it holds the most it may (counted
    /// in [`CONNECTIONS_REFUSED`]).
    pub fn admit(self: &Arc<Self>, peer: IpAddr) -> Option<ConnectionPermit> {
        let peer = peer.to_canonical();
        if peer.is_loopback() {
            return Some(ConnectionPermit {
                connections: self.clone(),
                peer: None,
            });
        }
        let mut open = self.open.lock().expect("connections lock");
        let count = open.entry(peer).or_insert(0);
        if *count >= self.per_peer_max {
            CONNECTIONS_REFUSED.fetch_add(1, Ordering::Relaxed);
            return None;
        }
        *count += 1;
        assert!(*count <= self.per_peer_max);
        Some(ConnectionPermit {
            connections: self.clone(),
            peer: Some(peer),
        })
    }

    /// The connections `peer` holds open (0 for loopback peers, which are not counted).
    pub fn open(&self, peer: IpAddr) -> usize {
        let open = self.open.lock().expect("connections lock");
        open.get(&peer.to_canonical()).copied().unwrap_or(0)
    }
}

impl Drop for ConnectionPermit {
    fn drop(&mut self) {
        let Some(peer) = self.peer else {
            return;
        };
        let mut open = self.connections.open.lock().expect("connections lock");
        let count = open
            .get_mut(&peer)
            .expect("an admitted peer is counted until its last permit is dropped");
        assert!(*count > 0);
        *count -= 1;
        if *count == 0 {
            open.remove(&peer);
        }
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn an_anonymous_connection_expires_and_an_authenticated_one_does_not() {
        let anonymous = Anonymous::new(Duration::from_secs(60));
        let (a, b): (SocketAddr, SocketAddr) = (
            "10.0.0.1:4000".parse().unwrap(),
            "10.0.0.1:4001".parse().unwrap(),
        );
        let t0 = Instant::now();
        assert!(!anonymous.expired(a, t0, t0 + Duration::from_secs(59)));
        assert!(anonymous.expired(a, t0, t0 + Duration::from_secs(60)));
        anonymous.authenticated(b);
        assert!(!anonymous.expired(b, t0, t0 + Duration::from_secs(3600)));
        // a closed connection is forgotten: its address and port may come back unauthenticated
        anonymous.forget(b);
        assert!(anonymous.expired(b, t0, t0 + Duration::from_secs(60)));
    }
    use super::*;

    /// Issue 22: a connection without a certificate has a few requests in flight at once, each
    /// connection apart, and an answered request frees its place.
    #[test]
    fn a_connection_without_a_certificate_has_few_requests_in_flight() {
        let anonymous = Anonymous::new(Duration::from_secs(60));
        let (a, b): (SocketAddr, SocketAddr) = (
            "10.0.0.1:4000".parse().unwrap(),
            "10.0.0.1:4001".parse().unwrap(),
        );
        let refused = ANONYMOUS_REQUESTS_REFUSED.load(Ordering::Relaxed);
        let mut held: Vec<_> = (0..ANONYMOUS_REQUESTS_PER_CONNECTION_MAX)
            .map(|_| anonymous.admit_request(a).expect("within the bound"))
            .collect();
        assert!(anonymous.admit_request(a).is_none(), "one more is refused");
        assert!(ANONYMOUS_REQUESTS_REFUSED.load(Ordering::Relaxed) > refused);
        assert!(
            anonymous.admit_request(b).is_some(),
            "another connection is apart"
        );
        held.pop();
        let again = anonymous.admit_request(a);
        assert!(again.is_some(), "an answered request frees its place");
        drop(again);
        held.clear();
        assert_eq!(anonymous.requests_in_flight(a), 0);
        assert!(
            anonymous.in_flight.lock().unwrap().is_empty(),
            "connections without requests in flight are not kept"
        );
    }

    /// Issue 22: one address cannot hold more than its share of a member's connections, and a
    /// closed connection frees its place.
    #[test]
    fn a_peer_holds_at_most_its_connections_and_closing_frees_them() {
        let connections = PeerConnections::new(3);
        let attacker: IpAddr = "192.0.2.7".parse().unwrap();
        let other: IpAddr = "192.0.2.8".parse().unwrap();
        let refused_before = CONNECTIONS_REFUSED.load(Ordering::Relaxed);
        let mut held: Vec<ConnectionPermit> = (0..3)
            .map(|_| connections.admit(attacker).unwrap())
            .collect();
        assert!(connections.admit(attacker).is_none());
        assert!(CONNECTIONS_REFUSED.load(Ordering::Relaxed) > refused_before);
        // The same address written as IPv4-mapped IPv6 is the same peer.
        let mapped: IpAddr = "::ffff:192.0.2.7".parse().unwrap();
        assert!(connections.admit(mapped).is_none());
        let _other = connections.admit(other).unwrap();
        assert_eq!(
            (connections.open(attacker), connections.open(other)),
            (3, 1)
        );
        held.pop();
        assert_eq!(connections.open(attacker), 2);
        held.push(connections.admit(attacker).unwrap());
        held.clear();
        assert_eq!(connections.open(attacker), 0);
        assert!(!connections.open.lock().unwrap().contains_key(&attacker));
        // Loopback peers are not counted.
        let local: Vec<ConnectionPermit> = (0..10)
            .map(|_| connections.admit("127.0.0.1".parse().unwrap()).unwrap())
            .collect();
        assert_eq!(local.len(), 10);
        assert_eq!(connections.open("127.0.0.1".parse().unwrap()), 0);
    }

    #[test]
    fn a_bucket_allows_its_burst_then_its_rate() {
        let start = Instant::now();
        let mut bucket = TokenBucket::new(10, 3, start);
        for _ in 0..3 {
            assert!(bucket.take(start).is_ok());
        }
        let wait = bucket.take(start).unwrap_err();
        assert!(wait <= Duration::from_millis(100), "{wait:?}");
        assert!(bucket.take(start + Duration::from_millis(100)).is_ok());
        assert!(bucket.take(start + Duration::from_millis(110)).is_err());
        // It never saves more than its burst.
        let later = start + Duration::from_secs(60);
        for _ in 0..3 {
            assert!(bucket.take(later).is_ok());
        }
        assert!(bucket.take(later).is_err());
    }

    /// Issue 22: one owner's churn is held to its rate, and others are not slowed by it.
    #[test]
    fn owners_are_limited_apart_and_keys_are_bounded() {
        let start = Instant::now();
        let mut owners = PerKey::new(OWNER_WRITES_PER_SECOND, OWNER_WRITES_BURST);
        let allowed = (0..1000)
            .filter(|_| owners.take("alice", start).is_ok())
            .count();
        assert_eq!(allowed, OWNER_WRITES_BURST as usize);
        assert!(owners.take("bob", start).is_ok());
        // Over one second alice gets her rate back, no more.
        let second = start + Duration::from_secs(1);
        let allowed = (0..1000)
            .filter(|_| owners.take("alice", second).is_ok())
            .count();
        assert_eq!(allowed, OWNER_WRITES_PER_SECOND as usize);
        let mut many = PerKey::new(1, 1);
        for key in 0..KEYS_MAX {
            assert!(many.take(&key.to_string(), start).is_ok());
        }
        assert!(many.take("one more", start).is_err(), "no key is full yet");
        let refilled = start + Duration::from_secs(2);
        assert!(many.take("one more", refilled).is_ok());
        assert!(many.buckets.len() <= KEYS_MAX);
    }
}

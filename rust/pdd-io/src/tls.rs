//! TLS 1.3 on lanes, both ends authenticated by certificates from one CA.
//!
//! A connector checks that the acceptor's certificate names `server_name`; an
//! acceptor requires a client certificate from the CA and, when `allowed_peers` is
//! not empty, one that names one of them. The peer's identity (the SHA-256 of its
//! leaf certificate) binds sessions: a lane that joins or resumes a session must come
//! from the identity that opened it. Where TLS runs, its AEAD authenticates every
//! byte, so the per-block CRC32C of KV_PAGES is negotiated off
//! ([`pdd_core::wire::capability::AEAD`]).
//!
//! [`TestPki`] makes a throwaway CA and leaf certificates for tests, benches and the
//! demo.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use pdd_core::Error;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::pool::RawPage;

/// TLS settings of an endpoint (both directions: it may connect and accept).
#[derive(Clone)]
pub struct TlsConfig {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
    server_name: ServerName<'static>,
    allowed_peers: Vec<ServerName<'static>>,
}

impl std::fmt::Debug for TlsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsConfig")
            .field("server_name", &self.server_name)
            .field("allowed_peers", &self.allowed_peers)
            .finish_non_exhaustive()
    }
}

/// Who is at the other end of a TLS lane.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    /// SHA-256 of the peer's leaf certificate (DER).
    pub fingerprint: [u8; 32],
    /// The allowed name it proved (acceptor side), or the name we asked for
    /// (connector side).
    pub name: Option<String>,
}

fn bad(what: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("TLS configuration: {what}"))
}

fn name(s: &str) -> Result<ServerName<'static>, Error> {
    ServerName::try_from(s.to_owned()).map_err(|e| bad(format!("name '{s}': {e}")))
}

impl TlsConfig {
    /// From PEM bytes: our certificate chain and private key, the CA that signs every
    /// peer, the name an acceptor's certificate must carry, and the names a connecting
    /// peer's certificate may carry (empty: any the CA signed).
    pub fn from_pem(
        cert_chain: &[u8],
        key: &[u8],
        ca: &[u8],
        server_name: &str,
        allowed_peers: &[String],
    ) -> Result<TlsConfig, Error> {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(cert_chain)
            .collect::<Result<_, _>>()
            .map_err(|e| bad(format!("certificate chain: {e}")))?;
        if certs.is_empty() {
            return Err(bad("the certificate file holds no certificate"));
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(|e| bad(format!("key: {e}")))?;
        let mut roots = rustls::RootCertStore::empty();
        let mut n = 0;
        for c in CertificateDer::pem_slice_iter(ca) {
            let c = c.map_err(|e| bad(format!("CA: {e}")))?;
            roots.add(c).map_err(|e| bad(format!("CA: {e}")))?;
            n += 1;
        }
        if n == 0 {
            return Err(bad("the CA file holds no certificate"));
        }
        let roots = Arc::new(roots);
        // AES-128-GCM first: as strong as needed here and a third cheaper per byte than
        // AES-256-GCM, which matters at tens of Gbit/s; the others stay as fallbacks.
        let mut provider = rustls::crypto::ring::default_provider();
        provider.cipher_suites = vec![
            rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
            rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384,
            rustls::crypto::ring::cipher_suite::TLS13_CHACHA20_POLY1305_SHA256,
        ];
        let provider = Arc::new(provider);
        let client = rustls::ClientConfig::builder_with_provider(provider.clone())
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(bad)?
            .with_root_certificates(roots.clone())
            .with_client_auth_cert(certs.clone(), key.clone_key())
            .map_err(|e| bad(format!("our certificate and key: {e}")))?;
        let verifier =
            rustls::server::WebPkiClientVerifier::builder_with_provider(roots, provider.clone())
                .build()
                .map_err(|e| bad(format!("client verifier: {e}")))?;
        let server = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])
            .map_err(bad)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs, key)
            .map_err(|e| bad(format!("our certificate and key: {e}")))?;
        let mut server = server;
        // No resumption tickets: every lane proves its certificate afresh, and nothing
        // arrives after the handshake that a sealed lane (which leaves TLS's record
        // layer after its HELLO) would have to read past.
        server.send_tls13_tickets = 0;
        Ok(TlsConfig {
            client: Arc::new(client),
            server: Arc::new(server),
            server_name: name(server_name)?,
            allowed_peers: allowed_peers
                .iter()
                .map(|s| name(s))
                .collect::<Result<_, _>>()?,
        })
    }

    /// [`TlsConfig::from_pem`] from files.
    pub fn from_files(
        cert_chain: &Path,
        key: &Path,
        ca: &Path,
        server_name: &str,
        allowed_peers: &[String],
    ) -> Result<TlsConfig, Error> {
        let read = |p: &Path| {
            std::fs::read(p).map_err(|e| bad(format!("cannot read {}: {e}", p.display())))
        };
        TlsConfig::from_pem(
            &read(cert_chain)?,
            &read(key)?,
            &read(ca)?,
            server_name,
            allowed_peers,
        )
    }

    /// The name acceptors must prove.
    pub fn server_name(&self) -> String {
        self.server_name.to_str().into_owned()
    }

    /// Client handshake on a connected socket: the acceptor must prove
    /// `server_name` with a certificate from the CA.
    pub async fn connect(&self, tcp: TcpStream) -> Result<(LaneStream, PeerIdentity), Error> {
        let connector = tokio_rustls::TlsConnector::from(self.client.clone());
        let tls = connector
            .connect(self.server_name.clone(), buffered(tcp))
            .await
            .map_err(|e| handshake_error("the accepting peer", e))?;
        let fingerprint = leaf_fingerprint(tls.get_ref().1.peer_certificates())?;
        Ok((
            LaneStream::TlsClient(Box::new(tls)),
            PeerIdentity {
                fingerprint,
                name: Some(self.server_name()),
            },
        ))
    }

    /// Server handshake: the peer must present a certificate from the CA that names
    /// one of `allowed_peers` (any, if that is empty).
    pub async fn accept(&self, tcp: TcpStream) -> Result<(LaneStream, PeerIdentity), Error> {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.server.clone());
        let tls = acceptor
            .accept(buffered(tcp))
            .await
            .map_err(|e| handshake_error("the connecting peer", e))?;
        let certs = tls.get_ref().1.peer_certificates();
        let fingerprint = leaf_fingerprint(certs)?;
        let name = self.allowed_name(certs)?;
        Ok((
            LaneStream::TlsServer(Box::new(tls)),
            PeerIdentity { fingerprint, name },
        ))
    }

    fn allowed_name(&self, certs: Option<&[CertificateDer<'_>]>) -> Result<Option<String>, Error> {
        if self.allowed_peers.is_empty() {
            return Ok(None);
        }
        let leaf = certs.and_then(|c| c.first()).ok_or(Error::AuthFailed {
            detail: "the peer presented no certificate",
        })?;
        let cert = webpki::EndEntityCert::try_from(leaf).map_err(|_| Error::AuthFailed {
            detail: "the peer's certificate does not parse",
        })?;
        for allowed in &self.allowed_peers {
            if cert.verify_is_valid_for_subject_name(allowed).is_ok() {
                return Ok(Some(allowed.to_str().into_owned()));
            }
        }
        Err(Error::AuthFailed {
            detail: "the peer's certificate names nobody on the allow-list",
        })
    }
}

/// The socket as TLS reads it. rustls pulls records in 4 KiB reads; a read buffer
/// underneath turns ~256 system calls per MiB into ~4 (profiled: the calls cost more
/// than the extra copy).
pub type TlsIo = tokio::io::BufReader<TcpStream>;

/// Read-buffer size under TLS.
const TLS_READ_BUFFER: usize = 256 << 10;

fn buffered(tcp: TcpStream) -> TlsIo {
    tokio::io::BufReader::with_capacity(TLS_READ_BUFFER, tcp)
}

fn handshake_error(who: &str, e: io::Error) -> Error {
    // A certificate or name refused is an authentication failure; anything else (a
    // reset, a timeout, a peer speaking plain text) is the connection's.
    let text = e.to_string();
    if e.kind() == io::ErrorKind::InvalidData
        && (text.contains("certificate") || text.contains("Certificate"))
    {
        Error::AuthFailed {
            detail: "TLS: a certificate was refused",
        }
    } else {
        Error::ConnectionLost {
            detail: format!("TLS handshake with {who}: {text}"),
        }
    }
}

fn leaf_fingerprint(certs: Option<&[CertificateDer<'_>]>) -> Result<[u8; 32], Error> {
    let leaf = certs.and_then(|c| c.first()).ok_or(Error::AuthFailed {
        detail: "the peer presented no certificate",
    })?;
    Ok(Sha256::digest(leaf.as_ref()).into())
}

/// A lane's byte stream: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum LaneStream {
    /// Plain TCP (integrity from the per-block CRC32C).
    Plain(TcpStream),
    /// TLS, we connected.
    TlsClient(Box<tokio_rustls::client::TlsStream<TlsIo>>),
    /// TLS, we accepted.
    TlsServer(Box<tokio_rustls::server::TlsStream<TlsIo>>),
}

impl LaneStream {
    /// The TCP socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            LaneStream::Plain(s) => s,
            LaneStream::TlsClient(s) => s.get_ref().0.get_ref(),
            LaneStream::TlsServer(s) => s.get_ref().0.get_ref(),
        }
    }

    /// Whether TLS runs on this lane.
    pub fn is_tls(&self) -> bool {
        !matches!(self, LaneStream::Plain(_))
    }

    /// Ready a data lane for bulk writes: rustls may then hold up to
    /// [`DATA_LANE_SEND_BUFFER`] bytes of records encrypted but not yet written (its
    /// default is 64 KiB). A write of a 1 MiB block is then encrypted whole and leaves
    /// in one `writev` of up to 64 records, instead of 16 writes of 64 KiB, each of
    /// which woke the receiver (profiled: those wakeups and system calls cost the
    /// sender more than AES-GCM did). A no-op on plain TCP.
    pub fn for_bulk_writes(&mut self) {
        match self {
            LaneStream::Plain(_) => {}
            LaneStream::TlsClient(s) => s.get_mut().1.set_buffer_limit(Some(DATA_LANE_SEND_BUFFER)),
            LaneStream::TlsServer(s) => s.get_mut().1.set_buffer_limit(Some(DATA_LANE_SEND_BUFFER)),
        }
    }

    /// Leave TLS's record layer on a data lane whose ends agreed on sealed lanes
    /// (`capability::SEALED_LANES`, see [`crate::sealed`]): export the lane's secret
    /// and return the bare socket with the record keys of its KV direction. Called
    /// by both ends right after the HELLO exchange, when TLS holds no byte in either
    /// direction. Bytes the peer sent early that rustls already decrypted, or that
    /// wait in the read buffer, are a violation; a part-record rustls holds is dropped,
    /// and the lane's next sealed record then fails its tag.
    pub fn into_sealed(self) -> Result<(TcpStream, crate::sealed::LaneKeys), Error> {
        match self {
            LaneStream::Plain(_) => Err(Error::InvalidArgument(
                "sealed lanes need TLS underneath".into(),
            )),
            LaneStream::TlsClient(s) => {
                let (io, mut conn) = (*s).into_inner();
                sealed_parts(io, &mut conn)
            }
            LaneStream::TlsServer(s) => {
                let (io, mut conn) = (*s).into_inner();
                sealed_parts(io, &mut conn)
            }
        }
    }

    /// Fill every page completely from a TLS lane's plaintext, each byte copied once,
    /// straight out of rustls's decrypted record into the page through raw pointers
    /// (no Rust reference to pool memory is formed while it is written). Every wait
    /// for bytes must end within `stall`. `UnexpectedEof` if the peer closes (with or
    /// without close_notify) before the last page is full.
    ///
    /// # Safety
    ///
    /// Every page must be valid for writes for its whole length and written by
    /// nothing else until the returned future completes or is dropped.
    pub async unsafe fn read_tls_into_pages(
        &mut self,
        pages: &[RawPage],
        stall: Duration,
    ) -> io::Result<()> {
        use tokio::io::AsyncBufReadExt;
        for page in pages {
            let mut at = 0;
            while at < page.len() {
                let chunk = match self {
                    LaneStream::Plain(_) => {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidInput,
                            "read_tls_into_pages on a plain lane",
                        ))
                    }
                    LaneStream::TlsClient(s) => fill_within(stall, s.as_mut()).await?,
                    LaneStream::TlsServer(s) => fill_within(stall, s.as_mut()).await?,
                };
                if chunk.is_empty() {
                    return Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "the peer closed the TLS lane mid-block",
                    ));
                }
                let n = chunk.len().min(page.len() - at);
                // SAFETY: `at + n <= len` keeps the copy inside the page, which the
                // caller guarantees is ours alone to write; `chunk` is rustls's buffer.
                unsafe {
                    std::ptr::copy_nonoverlapping(chunk.as_ptr(), page.as_ptr().add(at), n);
                }
                match self {
                    LaneStream::Plain(_) => unreachable!("checked above"),
                    LaneStream::TlsClient(s) => s.as_mut().consume(n),
                    LaneStream::TlsServer(s) => s.as_mut().consume(n),
                }
                at += n;
            }
        }
        Ok(())
    }
}

fn sealed_parts<D>(
    io: TlsIo,
    conn: &mut rustls::ConnectionCommon<D>,
) -> Result<(TcpStream, crate::sealed::LaneKeys), Error> {
    use std::io::Read;
    let early = |what: &str| Error::InvalidField {
        kind: pdd_core::wire::FrameKind::KvPages,
        field: "sealed lane",
        detail: format!("{what} arrived before the lane left TLS"),
    };
    if conn.wants_write() {
        return Err(Error::InvalidArgument(
            "sealed lanes: TLS records still unwritten at the switch".into(),
        ));
    }
    match conn.reader().read(&mut [0u8; 1]) {
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
        Ok(0) | Err(_) => {
            return Err(Error::ConnectionLost {
                detail: "the peer closed the lane's TLS session".into(),
            })
        }
        Ok(_) => return Err(early("data")),
    }
    if !io.buffer().is_empty() {
        return Err(early("TLS records"));
    }
    let suite = conn
        .negotiated_cipher_suite()
        .ok_or_else(|| Error::InvalidArgument("sealed lanes: the handshake is not done".into()))?;
    let algorithm = crate::sealed::algorithm_of(suite.suite())?;
    let secret = conn
        .export_keying_material(
            [0u8; 32],
            crate::sealed::EXPORTER_LABEL,
            Some(crate::sealed::EXPORTER_CONTEXT),
        )
        .map_err(|e| Error::InvalidArgument(format!("sealed lanes: TLS exporter: {e}")))?;
    Ok((
        io.into_inner(),
        crate::sealed::LaneKeys::new(&secret, algorithm),
    ))
}

/// Bytes of TLS records a data lane's rustls may hold encrypted but not yet written
/// (see [`LaneStream::for_bulk_writes`]): a whole 1 MiB block and its record overhead,
/// with room for a second one. Bounded: a peer that stops reading holds at most this
/// much per lane, and the lane's write stalls (and ends at the dead-peer bound).
pub const DATA_LANE_SEND_BUFFER: usize = 2 << 20;

/// The next decrypted bytes of `s` (empty at the peer's close), waiting at most
/// `stall` for them.
async fn fill_within<S: tokio::io::AsyncBufRead + Unpin>(
    stall: Duration,
    s: &mut S,
) -> io::Result<&[u8]> {
    use tokio::io::AsyncBufReadExt;
    match tokio::time::timeout(stall, s.fill_buf()).await {
        Ok(r) => r,
        Err(_) => Err(io::Error::new(
            io::ErrorKind::TimedOut,
            format!("stalled mid-block: no byte for {stall:?}"),
        )),
    }
}

macro_rules! delegate {
    ($self:ident, $s:ident => $e:expr) => {
        match $self.get_mut() {
            LaneStream::Plain($s) => {
                let $s = Pin::new($s);
                $e
            }
            LaneStream::TlsClient($s) => {
                let $s = Pin::new($s.as_mut());
                $e
            }
            LaneStream::TlsServer($s) => {
                let $s = Pin::new($s.as_mut());
                $e
            }
        }
    };
}

impl AsyncRead for LaneStream {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_read(cx, buf))
    }
}

impl AsyncWrite for LaneStream {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        delegate!(self, s => s.poll_write_vectored(cx, bufs))
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        delegate!(self, s => s.poll_shutdown(cx))
    }
}

/// A throwaway certificate authority and leaf certificates signed by it, as PEM: for
/// tests, benches and demos, never for production.
#[derive(Debug, Clone)]
pub struct TestPki {
    /// The CA certificate.
    pub ca_pem: String,
    /// Per name: (certificate chain, private key).
    pub leaves: Vec<(String, String, String)>,
}

impl TestPki {
    /// A CA and one leaf per name (each leaf certificate names itself, for both TLS
    /// client and server use).
    pub fn generate(names: &[String]) -> Result<TestPki, Error> {
        use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair};
        let fail = |e: rcgen::Error| Error::InvalidArgument(format!("test PKI: {e}"));
        let mut ca_params = CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
        ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        ca_params
            .distinguished_name
            .push(DnType::CommonName, "pdd_transport test CA");
        ca_params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let ca_key = KeyPair::generate().map_err(fail)?;
        let ca_cert = ca_params.self_signed(&ca_key).map_err(fail)?;
        let issuer = Issuer::new(ca_params, ca_key);
        let mut leaves = Vec::with_capacity(names.len());
        for n in names {
            let mut p = CertificateParams::new(vec![n.clone()]).map_err(fail)?;
            p.distinguished_name.push(DnType::CommonName, n.as_str());
            p.use_authority_key_identifier_extension = true;
            p.extended_key_usages = vec![
                rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                rcgen::ExtendedKeyUsagePurpose::ClientAuth,
            ];
            let key = KeyPair::generate().map_err(fail)?;
            let cert = p.signed_by(&key, &issuer).map_err(fail)?;
            leaves.push((n.clone(), cert.pem(), key.serialize_pem()));
        }
        Ok(TestPki {
            ca_pem: ca_cert.pem(),
            leaves,
        })
    }

    /// The TLS configuration of leaf `name`, expecting acceptors to be `server_name`
    /// and allowing `allowed_peers` to connect.
    pub fn config(
        &self,
        name: &str,
        server_name: &str,
        allowed_peers: &[String],
    ) -> Result<TlsConfig, Error> {
        let (_, cert, key) = self
            .leaves
            .iter()
            .find(|(n, _, _)| n == name)
            .ok_or_else(|| Error::InvalidArgument(format!("test PKI has no leaf '{name}'")))?;
        TlsConfig::from_pem(
            cert.as_bytes(),
            key.as_bytes(),
            self.ca_pem.as_bytes(),
            server_name,
            allowed_peers,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::IoSlice;
    use tokio::io::AsyncWriteExt;

    /// A TLS lane pair over loopback: (the connector's end, the acceptor's end).
    async fn pair() -> (LaneStream, LaneStream) {
        let names = vec!["md.example".to_string(), "p1.example".to_string()];
        let pki = TestPki::generate(&names).unwrap();
        let server = pki.config("md.example", "md.example", &[]).unwrap();
        let client = pki.config("p1.example", "md.example", &[]).unwrap();
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let accept = tokio::spawn(async move {
            let (tcp, _) = listener.accept().await.unwrap();
            server.accept(tcp).await.unwrap().0
        });
        let tcp = TcpStream::connect(addr).await.unwrap();
        let c = client.connect(tcp).await.unwrap().0;
        (c, accept.await.unwrap())
    }

    fn pattern(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i.wrapping_mul(131) >> 3) as u8).collect()
    }

    struct Pages(Vec<Vec<u8>>);

    impl Pages {
        fn new(sizes: &[usize]) -> Pages {
            Pages(sizes.iter().map(|&n| vec![0u8; n]).collect())
        }

        fn raw(&mut self) -> Vec<RawPage> {
            self.0
                .iter_mut()
                .map(|p| RawPage::for_test(p.as_mut_ptr(), p.len()))
                .collect()
        }
    }

    const STALL: Duration = Duration::from_secs(5);

    /// Pages that do not line up with records (16 KiB of plaintext at most), records
    /// split across socket reads and pages, writes of odd sizes: every byte lands
    /// where it belongs, and the bytes after the pages stay unread for the next block.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn pages_fill_from_records_that_straddle_them() {
        let (mut tx, mut rx) = pair().await;
        let sizes = [5000, 40_000, 1, 16_384, 70_001];
        let total: usize = sizes.iter().sum();
        let data = pattern(total + 3);
        let sent = data.clone();
        let writer = tokio::spawn(async move {
            // Odd write sizes, flushed one by one: records of every length, some
            // arriving in pieces.
            for piece in sent.chunks(7_777) {
                tx.write_all(piece).await.unwrap();
                tx.flush().await.unwrap();
            }
            tx
        });
        let mut pages = Pages::new(&sizes);
        let raw = pages.raw();
        // SAFETY: the pages are this test's own buffers, untouched until it returns.
        unsafe { rx.read_tls_into_pages(&raw, STALL) }
            .await
            .unwrap();
        let mut at = 0;
        for p in &pages.0 {
            assert_eq!(p[..], data[at..at + p.len()]);
            at += p.len();
        }
        let mut tail = [0u8; 3];
        tokio::io::AsyncReadExt::read_exact(&mut rx, &mut tail)
            .await
            .unwrap();
        assert_eq!(tail[..], data[total..]);
        drop(writer.await.unwrap());
    }

    /// A peer that closes mid-block, with close_notify or by dropping the socket
    /// mid-record, is an error (`UnexpectedEof`), never a block that counts as full.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_close_mid_block_is_an_error() {
        // Clean TLS close after half the block.
        let (mut tx, mut rx) = pair().await;
        tx.write_all(&pattern(30_000)).await.unwrap();
        tx.shutdown().await.unwrap();
        let mut pages = Pages::new(&[20_000, 20_000]);
        let raw = pages.raw();
        // SAFETY: the test's own buffers.
        let err = unsafe { rx.read_tls_into_pages(&raw, STALL) }
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
        assert_eq!(pages.0[0][..], pattern(20_000)[..]);

        // The socket dropped in the middle of a record (truncation, no close_notify).
        let (tx, mut rx) = pair().await;
        let LaneStream::TlsClient(s) = tx else {
            panic!("client end")
        };
        let (io, mut conn) = s.into_inner();
        let mut tcp = io.into_inner();
        std::io::Write::write_all(&mut conn.writer(), &pattern(10_000)).unwrap();
        let mut records = Vec::new();
        while conn.wants_write() {
            conn.write_tls(&mut records).unwrap();
        }
        tcp.write_all(&records[..records.len() - 100])
            .await
            .unwrap();
        // FIN after the cut (a drop could turn into a reset, whose error says less).
        tcp.shutdown().await.unwrap();
        let mut pages = Pages::new(&[10_000]);
        let raw = pages.raw();
        // SAFETY: the test's own buffers.
        let err = unsafe { rx.read_tls_into_pages(&raw, STALL) }
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::UnexpectedEof, "{err}");
        drop(tcp);
    }

    /// A peer that stops sending mid-block fails the read at the stall bound.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_stall_mid_block_times_out() {
        let (mut tx, mut rx) = pair().await;
        tx.write_all(&pattern(1000)).await.unwrap();
        tx.flush().await.unwrap();
        let mut pages = Pages::new(&[4000]);
        let raw = pages.raw();
        // SAFETY: the test's own buffers.
        let err = unsafe { rx.read_tls_into_pages(&raw, Duration::from_millis(200)) }
            .await
            .unwrap_err();
        assert_eq!(err.kind(), io::ErrorKind::TimedOut, "{err}");
        assert!(err.to_string().contains("stalled mid-block"), "{err}");
        drop(tx);
    }

    /// A data lane's rustls takes a whole 1 MiB block in one write (rustls's default
    /// holds 64 KiB), so the block leaves in few large system calls.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_bulk_lane_takes_a_whole_block_per_write() {
        let (mut tx, mut rx) = pair().await;
        let block = pattern(1 << 20);
        let reader = tokio::spawn(async move {
            let mut got = vec![0u8; 2 << 20];
            tokio::io::AsyncReadExt::read_exact(&mut rx, &mut got)
                .await
                .unwrap();
            got
        });
        let default = tx.write_vectored(&[IoSlice::new(&block)]).await.unwrap();
        assert!(default <= 64 << 10, "rustls's default took {default}");
        tx.write_all(&block[default..]).await.unwrap();
        tx.for_bulk_writes();
        let taken = tx.write_vectored(&[IoSlice::new(&block)]).await.unwrap();
        assert_eq!(taken, block.len());
        tx.flush().await.unwrap();
        let got = reader.await.unwrap();
        assert_eq!(got[..1 << 20], block[..]);
        assert_eq!(got[1 << 20..], block[..]);
    }
}

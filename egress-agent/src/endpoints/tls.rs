//! TLS for the endpoints (`--metrics-tls-cert-file`, `--metrics-tls-key-file`) and, with
//! `--metrics-client-ca-file`, client certificates for `/metrics` and `/status`, as
//! OpenShift's cluster monitoring scrapes (its Prometheus presents a client certificate).
//! `/healthz` and `/readyz` stay open to clients without one: the kubelet's HTTPS probes
//! present none. The files are read again every [`RELOAD`], so a certificate that
//! cert-manager or OpenShift's service CA rotates is served without a restart; a file
//! that turns bad keeps the last good configuration and is logged.

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use rustls::{
    RootCertStore, ServerConfig, crypto::ring::default_provider, server::WebPkiClientVerifier,
};
use rustls_pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject as _};

/// How often the files are read again.
pub const RELOAD: Duration = Duration::from_secs(30);

/// Where the endpoints' certificate, key and client CA are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// PEM certificate chain, leaf first.
    pub cert: PathBuf,
    /// PEM private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM CA certificates: a client must present a certificate one of them signed to
    /// read `/metrics` and `/status`.
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("failed to read {flag} {}: {source}", path.display())]
    Pem {
        flag: &'static str,
        path: PathBuf,
        source: rustls_pki_types::pem::Error,
    },
    #[error("{flag} {} holds no PEM certificate", path.display())]
    NoCertificate { flag: &'static str, path: PathBuf },
    #[error("{flag} {}: {source}", path.display())]
    Rustls {
        flag: &'static str,
        path: PathBuf,
        source: rustls::Error,
    },
    #[error("--metrics-client-ca-file {}: {source}", path.display())]
    ClientCa {
        path: PathBuf,
        source: rustls::server::VerifierBuilderError,
    },
}

fn certificates(flag: &'static str, path: &Path) -> Result<Vec<CertificateDer<'static>>, Error> {
    let pem = |source| Error::Pem {
        flag,
        path: path.to_owned(),
        source,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(pem)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem)?;
    if certs.is_empty() {
        return Err(Error::NoCertificate {
            flag,
            path: path.to_owned(),
        });
    }
    Ok(certs)
}

impl TlsFiles {
    /// The server configuration these files make, or what is wrong with them (naming the
    /// flag and the file).
    pub fn load(&self) -> Result<Arc<ServerConfig>, Error> {
        const CERT: &str = "--metrics-tls-cert-file";
        const KEY: &str = "--metrics-tls-key-file";
        let provider = Arc::new(default_provider());
        let certs = certificates(CERT, &self.cert)?;
        let key = PrivateKeyDer::from_pem_file(&self.key).map_err(|source| Error::Pem {
            flag: KEY,
            path: self.key.clone(),
            source,
        })?;
        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|source| Error::Rustls {
                flag: CERT,
                path: self.cert.clone(),
                source,
            })?;
        let builder = match &self.client_ca {
            None => builder.with_no_client_auth(),
            Some(ca) => {
                let mut roots = RootCertStore::empty();
                for c in certificates("--metrics-client-ca-file", ca)? {
                    roots.add(c).map_err(|source| Error::Rustls {
                        flag: "--metrics-client-ca-file",
                        path: ca.clone(),
                        source,
                    })?;
                }
                // Without a certificate the handshake still succeeds (the kubelet's
                // probes); the handler refuses such clients what needs one.
                let verifier = WebPkiClientVerifier::builder_with_provider(roots.into(), provider)
                    .allow_unauthenticated()
                    .build()
                    .map_err(|source| Error::ClientCa {
                        path: ca.clone(),
                        source,
                    })?;
                builder.with_client_cert_verifier(verifier)
            }
        };
        let mut config = builder
            .with_single_cert(certs, key)
            .map_err(|source| Error::Rustls {
                flag: KEY,
                path: self.key.clone(),
                source,
            })?;
        config.alpn_protocols = vec![b"http/1.1".to_vec()];
        Ok(Arc::new(config))
    }
}

/// The configuration in use, swapped when the files change and still load.
pub struct Reloading {
    files: TlsFiles,
    current: RwLock<Arc<ServerConfig>>,
}

impl Reloading {
    /// Load the files now (an error stops the start) and again every `every` in the
    /// background ([`RELOAD`]), until the last handle is dropped.
    pub fn start(files: TlsFiles, every: Duration) -> Result<Arc<Self>, Error> {
        let first = files.load()?;
        let me = Arc::new(Self {
            files,
            current: RwLock::new(first),
        });
        let weak = Arc::downgrade(&me);
        tokio::spawn(async move {
            let mut last_error = None;
            loop {
                tokio::time::sleep(every).await;
                let Some(me) = weak.upgrade() else { return };
                match me.files.load() {
                    Ok(config) => {
                        *me.current.write().unwrap_or_else(|e| e.into_inner()) = config;
                        last_error = None;
                    }
                    Err(e) => {
                        let text = e.to_string();
                        if last_error.as_ref() != Some(&text) {
                            tracing::warn!(
                                "the endpoints keep their last good TLS configuration: {text}"
                            );
                        }
                        last_error = Some(text);
                    }
                }
            }
        });
        Ok(me)
    }

    pub fn current(&self) -> Arc<ServerConfig> {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Whether `/metrics` and `/status` need a client certificate.
    pub fn needs_client_certificate(&self) -> bool {
        self.files.client_ca.is_some()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A CA and what it signs, in PEM.
    pub(crate) struct Ca {
        key: rcgen::KeyPair,
        cert: rcgen::Certificate,
    }

    impl Ca {
        pub(crate) fn new(name: &str) -> Self {
            let key = rcgen::KeyPair::generate().expect("key");
            let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).expect("params");
            params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, name);
            let cert = params.self_signed(&key).expect("self-signed");
            Self { key, cert }
        }

        pub(crate) fn pem(&self) -> String {
            self.cert.pem()
        }

        pub(crate) fn der(&self) -> CertificateDer<'static> {
            self.cert.der().clone()
        }

        /// (certificate PEM, key PEM) for `name` (an IP address or a DNS name), for a
        /// server or a client.
        pub(crate) fn issue(&self, name: &str, client: bool) -> (String, String) {
            let key = rcgen::KeyPair::generate().expect("key");
            let mut params = rcgen::CertificateParams::new(vec![name.to_owned()]).expect("params");
            params.extended_key_usages = vec![if client {
                rcgen::ExtendedKeyUsagePurpose::ClientAuth
            } else {
                rcgen::ExtendedKeyUsagePurpose::ServerAuth
            }];
            let cert = params
                .signed_by(&key, &self.cert, &self.key)
                .expect("signed");
            (cert.pem(), key.serialize_pem())
        }
    }

    /// Files for a server certificate of 127.0.0.1 from `ca`, in `dir`.
    pub(crate) fn write_files(dir: &Path, ca: &Ca, client_ca: Option<&Ca>) -> TlsFiles {
        let (cert, key) = ca.issue("127.0.0.1", false);
        let files = TlsFiles {
            cert: dir.join("tls.crt"),
            key: dir.join("tls.key"),
            client_ca: client_ca.map(|_| dir.join("client-ca.crt")),
        };
        std::fs::write(&files.cert, cert).expect("write");
        std::fs::write(&files.key, key).expect("write");
        if let (Some(path), Some(ca)) = (&files.client_ca, client_ca) {
            std::fs::write(path, ca.pem()).expect("write");
        }
        files
    }

    #[test]
    fn bad_files_name_the_flag_and_the_file() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Ca::new("server CA");
        let files = write_files(dir.path(), &ca, None);
        assert!(files.load().is_ok());
        let missing = TlsFiles {
            cert: dir.path().join("nope.crt"),
            ..files.clone()
        };
        let e = missing.load().expect_err("missing").to_string();
        assert!(
            e.contains("--metrics-tls-cert-file") && e.contains("nope.crt"),
            "{e}"
        );
        std::fs::write(dir.path().join("empty.crt"), "not a certificate\n").expect("write");
        let empty = TlsFiles {
            cert: dir.path().join("empty.crt"),
            ..files.clone()
        };
        let e = empty.load().expect_err("empty").to_string();
        assert!(e.contains("holds no PEM certificate"), "{e}");
        // A key that is not the certificate's.
        let (_, other_key) = ca.issue("127.0.0.1", false);
        std::fs::write(dir.path().join("other.key"), other_key).expect("write");
        let mismatched = TlsFiles {
            key: dir.path().join("other.key"),
            ..files.clone()
        };
        let e = mismatched.load().expect_err("mismatched").to_string();
        assert!(e.contains("--metrics-tls-key-file"), "{e}");
        let no_ca = TlsFiles {
            client_ca: Some(dir.path().join("empty.crt")),
            ..files
        };
        let e = no_ca.load().expect_err("no CA").to_string();
        assert!(e.contains("--metrics-client-ca-file"), "{e}");
    }

    /// A rotated certificate is taken on the next reload; a file that turns bad keeps
    /// the last good configuration.
    #[tokio::test]
    async fn a_rotated_certificate_is_served_and_a_bad_one_is_not() {
        let dir = tempfile::tempdir().expect("tempdir");
        let ca = Ca::new("server CA");
        let files = write_files(dir.path(), &ca, None);
        let every = Duration::from_millis(50);
        let tls = Reloading::start(files.clone(), every).expect("start");
        let first = tls.current();
        write_files(dir.path(), &ca, None);
        tokio::time::sleep(every * 4).await;
        let second = tls.current();
        assert!(
            !Arc::ptr_eq(&first, &second),
            "the rotated files were not taken"
        );
        std::fs::write(&files.cert, "garbage\n").expect("write");
        tokio::time::sleep(every * 4).await;
        assert!(
            Arc::ptr_eq(&second, &tls.current()),
            "a bad file replaced the configuration"
        );
    }
}

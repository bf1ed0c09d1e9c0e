//! The `tollgate` command: run the proxy, or only check a configuration file.

#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use tokio::net::TcpListener;
use tollgate::config::Config;
use tollgate::Sockets;

/// Exit status for a configuration that cannot be used (EX_USAGE).
const EXIT_BAD_CONFIG: u8 = 64;

/// An HTTP egress proxy that keeps outbound calls inside upstream rate limits.
#[derive(Parser)]
#[command(version, about)]
struct Cli {
    /// The configuration file.
    #[arg(long, short, env = "TOLLGATE_CONFIG", default_value = "config.toml")]
    config: PathBuf,
    /// Listen on this address instead of `proxy.listen`.
    #[arg(long, env = "TOLLGATE_LISTEN")]
    listen: Option<SocketAddr>,
    /// Log format; the level comes from RUST_LOG (default "info").
    #[arg(long, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
    /// Threads that serve connections, each with its own listening socket (default: one
    /// per core).
    #[arg(long, env = "TOLLGATE_WORKER_THREADS")]
    worker_threads: Option<usize>,
    /// Share the proxy's port with another process already serving it (a blue-green
    /// switch); without it, tollgate refuses to start on a port that is served.
    #[arg(long, env = "TOLLGATE_REUSE_PORT")]
    reuse_port: bool,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Check a configuration file and exit: 0 if usable, 64 with file:line:column if not.
    CheckConfig {
        /// The file to check.
        file: PathBuf,
    },
    /// Check a running tollgate: GET its admin `/healthz`; exit 0 on 200, 1 otherwise
    /// (for container health checks, where there is no curl).
    Health {
        /// The URL to check.
        #[arg(
            long,
            env = "TOLLGATE_HEALTH_URL",
            default_value = "http://127.0.0.1:9090/healthz"
        )]
        url: String,
        /// Give up after this many seconds.
        #[arg(long, default_value_t = 2.0)]
        timeout: f64,
    },
    /// The CA that signs certificates for intercepted hosts (`[intercept]`).
    Ca {
        #[command(subcommand)]
        command: CaCommand,
    },
}

#[derive(Subcommand)]
enum CaCommand {
    /// Make a new CA: writes DIR/ca.pem and DIR/ca-key.pem (mode 0600), and prints how
    /// to make clients trust it.
    Init {
        /// Where to write the two files (made if missing; existing files are kept).
        #[arg(long)]
        dir: PathBuf,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum LogFormat {
    Text,
    Json,
}

/// mimalloc instead of glibc's malloc: every proxied request allocates and frees a few
/// dozen small blocks, and glibc kept giving the top of its heap back to the kernel and
/// taking it again, page faults included, about 4 µs of CPU per request more. Built to
/// commit memory as it is used (`.cargo/config.toml`), so a proxy with many waiting
/// requests stays near glibc's resident size.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    // First, while this is the only thread (see `descriptors` for why).
    let descriptors = tollgate::descriptors::prepare();
    let cli = Cli::parse();
    if let Some(Command::Ca {
        command: CaCommand::Init { dir },
    }) = &cli.command
    {
        return ca_init(dir);
    }
    if let Some(Command::Health { url, timeout }) = &cli.command {
        return health(url, *timeout);
    }
    init_logging(cli.log_format);
    tracing::debug!(
        limit = ?descriptors.limit,
        limit_before = ?descriptors.limit_before,
        table = descriptors.table,
        "file descriptors"
    );
    for e in &descriptors.errors {
        tracing::warn!(error = %e, "cannot raise the open-file limit or grow the descriptor table");
    }
    let threads = cli
        .worker_threads
        .filter(|n| *n > 0)
        .or_else(|| std::thread::available_parallelism().ok().map(|n| n.get()))
        .unwrap_or(1);
    // This thread serves too; `server::run` starts the others, each with a runtime of
    // its own (see there for why).
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("the tokio runtime starts");
    runtime.block_on(run(cli, threads, descriptors.limit))
}

async fn run(cli: Cli, threads: usize, open_file_limit: Option<u64>) -> ExitCode {
    let path = match &cli.command {
        Some(Command::CheckConfig { file }) => file,
        _ => &cli.config,
    };
    let mut config = match Config::load(path) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("tollgate: {e}");
            return ExitCode::from(EXIT_BAD_CONFIG);
        }
    };
    // The files and the Redis URL the config names, checked before anything listens;
    // without side effects (nothing is dialled), so check-config may run anywhere.
    if let Err(e) = tollgate::external::check(&config) {
        eprintln!("tollgate: {e}");
        return ExitCode::from(EXIT_BAD_CONFIG);
    }
    let blind = (config.intercept.as_ref())
        .and_then(|i| tollgate::blind_intercept(i, &config.proxy.connect_ports));
    if let Some(Command::CheckConfig { file }) = &cli.command {
        if let Some(blind) = blind {
            eprintln!("warning: {}: {blind}", file.display());
        }
        println!("{}: ok", file.display());
        return ExitCode::SUCCESS;
    }
    if let Some(listen) = cli.listen {
        config.proxy.listen = listen;
    }
    warn_if_queues_outgrow(&config, open_file_limit);
    if let Some(blind) = blind {
        tracing::warn!("{blind}");
    }
    let listen = config.proxy.listen;
    let sockets = match Sockets::listen(listen, threads, cli.reuse_port) {
        Ok(sockets) => sockets,
        Err(e) => {
            eprintln!("tollgate: cannot listen on {listen}: {e}");
            return ExitCode::FAILURE;
        }
    };
    let admin = match config.admin.as_ref().map(|a| a.listen) {
        None => None,
        Some(addr) => match TcpListener::bind(addr).await {
            Ok(admin) => {
                // The bound address, not the configured one: with port 0 the kernel
                // chose it, and whoever started tollgate reads it here.
                let listen = admin.local_addr().unwrap_or(addr);
                tracing::info!(%listen, "admin endpoints listening");
                Some(admin)
            }
            Err(e) => {
                eprintln!("tollgate: cannot listen on {addr} (admin): {e}");
                return ExitCode::FAILURE;
            }
        },
    };
    let listen = sockets.local_addr().unwrap_or(listen);
    tracing::info!(%listen, threads, "tollgate listening");
    match tollgate::run(sockets, admin, config, shutdown_signal()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate: {e}");
            ExitCode::from(EXIT_BAD_CONFIG)
        }
    }
}

/// `tollgate health`: quiet on success, the reason on stderr otherwise.
fn health(url: &str, timeout: f64) -> ExitCode {
    let timeout = std::time::Duration::try_from_secs_f64(timeout)
        .unwrap_or(std::time::Duration::from_secs(2));
    match tollgate::health::check(url, timeout) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tollgate: {url}: {e}");
            ExitCode::FAILURE
        }
    }
}

/// `tollgate ca init`: writes a new CA and says how to trust it.
fn ca_init(dir: &std::path::Path) -> ExitCode {
    let (cert, key) = match tollgate::init_ca(dir) {
        Ok(paths) => paths,
        Err(e) => {
            eprintln!("tollgate: {e}");
            return ExitCode::FAILURE;
        }
    };
    let (cert, key) = (cert.display(), key.display());
    println!(
        "\
wrote {cert} (the CA certificate: give it to clients)
  and {key} (its private key: readable by tollgate alone; keep it secret)

In config.toml:

  [intercept]
  ca_cert = \"{cert}\"
  ca_key  = \"{key}\"

Make the clients that use tollgate as HTTPS_PROXY trust the CA:

  curl                   curl --cacert {cert} ...   or  CURL_CA_BUNDLE={cert}
  Python requests        REQUESTS_CA_BUNDLE={cert}
  Python stdlib, httpx,  SSL_CERT_FILE={cert}
    aiohttp
  Node.js                NODE_EXTRA_CA_CERTS={cert}
  Java                   keytool -importcert -alias tollgate -file {cert} \\
                           -keystore $JAVA_HOME/lib/security/cacerts
  Debian/Ubuntu (all)    cp {cert} /usr/local/share/ca-certificates/tollgate.crt \\
                           && update-ca-certificates

REQUESTS_CA_BUNDLE, SSL_CERT_FILE and CURL_CA_BUNDLE replace the usual trust store: to
reach hosts tollgate does not intercept too, point them at a bundle that holds both
(e.g. cat /etc/ssl/certs/ca-certificates.crt {cert} > bundle.pem)."
    );
    ExitCode::SUCCESS
}

/// Warns when a group's `queue` could hold more requests than the process may open
/// descriptors (each waiting request holds its client's socket): connections beyond the
/// limit would be refused at accept, long before the queue is full.
fn warn_if_queues_outgrow(config: &Config, limit: Option<u64>) {
    let Some(limit) = limit else { return };
    let groups = std::iter::once(("[defaults]", &config.defaults))
        .chain(config.limits.iter().map(|l| (l.name.as_str(), &l.settings)));
    if let Some((group, settings)) = groups.max_by_key(|(_, s)| s.queue) {
        if settings.queue as u64 >= limit {
            tracing::warn!(
                open_file_limit = limit,
                queue = settings.queue,
                group,
                "the open-file limit is below this group's queue: raise the hard limit \
                 (ulimit -Hn, LimitNOFILE=, docker run --ulimit nofile=)"
            );
        }
    }
}

/// Completes on the first SIGTERM or SIGINT.
async fn shutdown_signal() {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler installs");
    let mut int = signal(SignalKind::interrupt()).expect("SIGINT handler installs");
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}

fn init_logging(format: LogFormat) {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Colour codes only for a person at a terminal: in a file, journald or `docker
    // logs` they are noise around every level and field name.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        LogFormat::Json => builder.json().init(),
    }
    tollgate::log_access_to_stderr(match format {
        LogFormat::Text => tollgate::AccessLogFormat::Text,
        LogFormat::Json => tollgate::AccessLogFormat::Json,
    });
}

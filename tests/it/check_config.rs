//! `tollgate check-config` never panics and has no side effects: it dials nothing (a
//! Redis backend is checked by its URL), reports unusable files at the line that names
//! them, and refuses absurd values with exit 64; the proxy refuses the same before it
//! listens.

use std::time::Duration;

use crate::support::*;

/// Runs `tollgate args…` to its end (at most [`BOUND`]).
async fn tollgate(args: &[&std::ffi::OsStr]) -> (Option<i32>, String, String) {
    let mut cmd = clean_command(env!("CARGO_BIN_EXE_tollgate"), &[("RUST_LOG", "info")]);
    cmd.args(args)
        .env_remove("TOLLGATE_CONFIG")
        .env_remove("TOLLGATE_LISTEN");
    let out = tokio::time::timeout(BOUND, cmd.output())
        .await
        .expect("tollgate ends")
        .unwrap();
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test]
async fn a_redis_backend_is_checked_without_dialling_it() {
    // A listener standing in for Redis: check-config must not connect to it.
    let redis = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let dir = tempfile::tempdir().unwrap();
    let config = write_file(
        dir.path(),
        "redis.toml",
        &format!(
            "[backend]\nkind = \"redis\"\nurl = \"redis://{}/0\"\n",
            redis.local_addr().unwrap()
        ),
    );
    let (code, stdout, stderr) = tollgate(&["check-config".as_ref(), config.as_os_str()]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.ends_with(": ok\n"), "{stdout}");
    let accepted = tokio::time::timeout(Duration::from_millis(200), redis.accept()).await;
    assert!(accepted.is_err(), "check-config connected to Redis");

    let bad = write_file(
        dir.path(),
        "bad-redis.toml",
        "[backend]\nkind = \"redis\"\nurl = \"redis://127.0.0.1:notaport/0\"\n",
    );
    let (code, _, stderr) = tollgate(&["check-config".as_ref(), bad.as_os_str()]).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(
        stderr.contains(&format!("{}:3:7: invalid Redis URL", bad.display())),
        "{stderr}"
    );
}

#[tokio::test]
async fn unusable_files_are_reported_at_their_line_before_anything_listens() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let config = write_file(
        dir.path(),
        "ca.toml",
        &format!("[proxy]\nca_file = {:?}\n", missing.display().to_string()),
    );
    let at = format!("{}:2:11: ca_file", config.display());
    let (code, _, stderr) = tollgate(&["check-config".as_ref(), config.as_os_str()]).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains(&at), "{stderr}");

    // Run with it: refused the same way, and nothing was said to listen.
    let listen = "127.0.0.1:0".to_string();
    let args = [
        "--config".as_ref(),
        config.as_os_str(),
        "--listen".as_ref(),
        listen.as_ref(),
    ];
    let (code, _, stderr) = tollgate(&args).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains(&at), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
}

#[tokio::test]
async fn absurd_values_are_refused_with_their_line_and_exit_64() {
    let dir = tempfile::tempdir().unwrap();
    let cases = [
        ("[defaults]\nmax_wait = \"500000000000y\"\n", ":2:12:"),
        ("[proxy]\nconnect_timeout = \"0s\"\n", ":2:19:"),
        ("[defaults]\nburst = 4294967295\n", ":2:9:"),
        ("[defaults]\nretry_statuses = [200]\n", ":2:19:"),
    ];
    for (i, (text, at)) in cases.into_iter().enumerate() {
        let config = write_file(dir.path(), &format!("c{i}.toml"), text);
        let (code, _, stderr) = tollgate(&["check-config".as_ref(), config.as_os_str()]).await;
        assert_eq!(code, Some(64), "{text}: {stderr}");
        assert!(
            stderr.contains(&format!("{}{at}", config.display())),
            "{text}: {stderr}"
        );
    }
}

/// `[intercept]` whose hosts (by default the limits' hosts, on ports 443 and 80) no
/// port in `connect_ports` reaches: the config is valid, so exit 0, but a warning
/// names the file, the hosts and the ports, since such tunnels would stay blind.
#[tokio::test]
async fn intercept_hosts_that_connect_ports_never_reach_are_warned_of() {
    let dir = tempfile::tempdir().unwrap();
    tollgate::init_ca(dir.path()).unwrap();
    let text = |connect: &str| {
        format!(
            "[proxy]\nconnect_ports = [{connect}]\n\n[intercept]\nca_cert = {:?}\n\
             ca_key = {:?}\n\n[[limit]]\nname = \"api\"\nhosts = [\"127.0.0.1\"]\n",
            dir.path().join("ca.pem").display().to_string(),
            dir.path().join("ca-key.pem").display().to_string(),
        )
    };
    let blind = write_file(dir.path(), "blind.toml", &text("8443"));
    let (code, stdout, stderr) = tollgate(&["check-config".as_ref(), blind.as_os_str()]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.ends_with(": ok\n"), "{stdout}");
    let warning = stderr
        .lines()
        .find(|l| l.starts_with("warning:"))
        .unwrap_or_else(|| panic!("no warning: {stderr}"));
    assert!(
        warning.starts_with(&format!(
            "warning: {}: [intercept] decrypts 127.0.0.1 (port 443, 80) only on ports \
             [proxy] connect_ports does not allow (8443)",
            blind.display()
        )),
        "{warning}"
    );

    let seen = write_file(dir.path(), "seen.toml", &text("443, 8443"));
    let (code, _, stderr) = tollgate(&["check-config".as_ref(), seen.as_os_str()]).await;
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("warning:"), "{stderr}");
}

/// `[backend] ca_file` (and the client certificate) is read like `[proxy] ca_file`: a
/// missing file or one without a certificate is refused at its line, and so is a
/// `ca_file` that no `rediss://` URL would use.
#[tokio::test]
async fn backend_tls_files_are_refused_at_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pem");
    let not_pem = write_file(dir.path(), "not.pem", "not a certificate\n");
    let shown = |p: &std::path::Path| format!("{:?}", p.display().to_string());
    let backend = |url: &str, ca: &std::path::Path| {
        format!(
            "[backend]\nkind = \"redis\"\nurl = \"{url}\"\nca_file = {}\n",
            shown(ca)
        )
    };
    let cases = [
        (backend("rediss://127.0.0.1:1", &missing), ":4:11: ca_file "),
        (backend("rediss://127.0.0.1:1", &not_pem), ":4:11: ca_file "),
        (
            backend("redis://127.0.0.1:1", &not_pem),
            ":4:11: ca_file is for rediss:// connections",
        ),
    ];
    for (i, (text, at)) in cases.into_iter().enumerate() {
        let config = write_file(dir.path(), &format!("c{i}.toml"), &text);
        let (code, _, stderr) = tollgate(&["check-config".as_ref(), config.as_os_str()]).await;
        assert_eq!(code, Some(64), "{text}: {stderr}");
        assert!(
            stderr.contains(&format!("{}{at}", config.display())),
            "{text}: {stderr}"
        );
    }
    let config = write_file(
        dir.path(),
        "run.toml",
        &backend("rediss://127.0.0.1:1", &not_pem),
    );
    let listen = "127.0.0.1:0".to_string();
    let args = [
        "--config".as_ref(),
        config.as_os_str(),
        "--listen".as_ref(),
        listen.as_ref(),
    ];
    let (code, _, stderr) = tollgate(&args).await;
    assert_eq!(code, Some(64), "{stderr}");
    assert!(stderr.contains("no PEM certificate found"), "{stderr}");
    assert!(!stderr.contains("listening"), "{stderr}");
}

//! Goal: the README's promise that a listen address on the command line replaces the config
//! file's, end to end: a file saying `port`, `bind` and `unix` opens none of them when the
//! command line says `--listen unix:…` (it once also opened the file's TCP port).
//! Method: one config file; a server started with only `--config` listens on the file's port
//! and socket (so the check below can fail); a server started with `--config` and `--listen`
//! serves on the command line's socket, while the file's port refuses connections and the
//! file's socket is never made.

mod common;

use std::net::TcpStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(30);

fn write_config(dir: &Path, port: u16, socket: &Path) -> String {
    let path = dir.join("serve.toml");
    std::fs::write(
        &path,
        format!(
            "backend = \"memory:16M\"\nport = {port}\nbind = \"127.0.0.1\"\nunix = \"{}\"\n",
            socket.display()
        ),
    )
    .unwrap();
    path.display().to_string()
}

#[test]
fn a_command_line_listen_replaces_the_config_files_port_bind_and_unix() {
    let name = "a_command_line_listen_replaces_the_config_files_port_bind_and_unix";
    let _timer = Timer::new(name);
    let dir = temp_dir();
    let port = free_tcp_port();
    let file_socket = dir.path().join("file.sock");
    let config = write_config(dir.path(), port, &file_socket);

    // Only the file: its port and its socket both serve.
    let mut file_only = ChildGuard::spawn(
        Command::new(bufcache_bin())
            .args(["serve", "--config", &config])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null()),
        "bufcache serve --config",
    );
    wait_until("the file's port and socket", TIMEOUT, || {
        assert!(file_only.running(), "serve --config exited");
        TcpStream::connect(("127.0.0.1", port)).is_ok() && file_socket.exists()
    });
    drop(file_only);
    let _ = std::fs::remove_file(&file_socket);

    // The file and a command-line listen: only the command line's socket.
    let server = Server::start(dir.path(), "listen", &["--config", &config]);
    let client = NbdClient::connect(&server.uri()).unwrap();
    let mut block = vec![1u8; 4096];
    client.read(0, &mut block).unwrap();
    assert!(
        block.iter().all(|&byte| byte == 0),
        "memory:16M reads as zeroes"
    );
    assert!(
        TcpStream::connect(("127.0.0.1", port)).is_err(),
        "the file's port {port} is open although the command line said where to listen"
    );
    assert!(
        !file_socket.exists(),
        "the file's socket {} was made",
        file_socket.display()
    );
}

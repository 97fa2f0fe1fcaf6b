//! Goal: `bufcache serve` behaves as service managers and nbdkit/qemu-nbd users expect.
//! Method: real `systemd-socket-activate` owning the listening socket and passing it
//! (LISTEN_FDS), a datagram socket standing in for systemd's NOTIFY_SOCKET, the pid file
//! compared with the process id, and the short flags (-r -U -e) checked through a client.

mod common;

use std::os::unix::net::UnixDatagram;
use std::process::{Command, Stdio};
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);

#[test]
fn socket_activation_readiness_and_pid_file_follow_systemd_conventions() {
    let _timer = Timer::new("socket_activation_readiness_and_pid_file_follow_systemd_conventions");
    if !have_tools("socket_activation", &["systemd-socket-activate"]) {
        return;
    }
    let dir = temp_dir();
    let socket = dir.path().join("activated.sock");
    let notify_path = dir.path().join("notify.sock");
    let notify = UnixDatagram::bind(&notify_path).unwrap();
    notify.set_read_timeout(Some(TIMEOUT)).unwrap();
    let pid_file = dir.path().join("bufcache.pid");
    let log = dir.path().join("serve.log");
    let log_file = std::fs::File::create(&log).unwrap();
    let mut command = Command::new(tool("systemd-socket-activate"));
    command
        .arg("-l")
        .arg(&socket)
        .arg(format!("--setenv=NOTIFY_SOCKET={}", notify_path.display()))
        .arg(bufcache_bin())
        .args(["serve", "--backend", "memory:16M", "--pid-file"])
        .arg(&pid_file)
        .current_dir(dir.path())
        .stdout(log_file.try_clone().unwrap())
        .stderr(log_file);
    let mut activator = ChildGuard::spawn(&mut command, "systemd-socket-activate");
    wait_until("systemd-socket-activate to listen", TIMEOUT, || {
        assert!(activator.running(), "systemd-socket-activate exited");
        socket.exists()
    });
    // The first connection starts bufcache, which must serve it on the inherited socket.
    let client = NbdClient::connect(&format!("nbd+unix:///?socket={}", socket.display()))
        .unwrap_or_else(|error| {
            panic!(
                "{error}\n{}",
                std::fs::read_to_string(&log).unwrap_or_default()
            )
        });
    let data = random_bytes(256 << 10, 71);
    client.write(4096, &data).unwrap();
    client.flush().unwrap();
    let mut buffer = vec![0u8; data.len()];
    client.read(4096, &mut buffer).unwrap();
    assert_same_bytes(&data, &buffer, "read back over the activated socket");

    let mut message = [0u8; 256];
    let length = notify
        .recv(&mut message)
        .expect("no readiness notification");
    assert_eq!(&message[..length], b"READY=1");
    // systemd-socket-activate execs the service in its own process.
    let pid = std::fs::read_to_string(&pid_file).expect("the pid file");
    assert_eq!(pid.trim(), activator.pid().to_string());
    drop(client);
    let status = activator
        .signal_and_wait(SIGTERM, TIMEOUT)
        .expect("no exit after SIGTERM");
    let text = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(status.success(), "{status}:\n{text}");
    assert!(!pid_file.exists(), "the pid file outlived the server");
    let length = notify.recv(&mut message).expect("no stopping notification");
    assert_eq!(&message[..length], b"STOPPING=1");
}

#[test]
fn short_flags_read_only_unix_socket_and_export_name_work_as_in_nbdkit() {
    let _timer = Timer::new("short_flags_read_only_unix_socket_and_export_name_work_as_in_nbdkit");
    let dir = temp_dir();
    let socket = dir.path().join("short.sock");
    let mut command = Command::new(bufcache_bin());
    command
        .args(["serve", "--backend", "memory:8M", "-r", "-e", "vol1", "-U"])
        .arg(&socket)
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut server = ChildGuard::spawn(&mut command, "bufcache serve");
    wait_until("bufcache serve to listen", TIMEOUT, || {
        assert!(server.running(), "bufcache serve exited");
        std::os::unix::net::UnixStream::connect(&socket).is_ok()
    });
    let client = NbdClient::connect(&format!("nbd+unix:///vol1?socket={}", socket.display()))
        .expect("export vol1 on the -U socket");
    assert!(
        client.export_info().read_only(),
        "-r did not make it read-only"
    );
    assert!(client.write(0, &[1u8; 4096]).is_err());
    drop(client);
    assert!(
        NbdClient::connect(&format!("nbd+unix:///other?socket={}", socket.display())).is_err(),
        "an export name never given was served"
    );
    let status = server.signal_and_wait(SIGTERM, TIMEOUT).expect("exit");
    assert!(status.success(), "{status}");
}

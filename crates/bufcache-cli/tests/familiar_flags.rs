//! Goal: the flags nbdkit and qemu-nbd users type do what they expect. Method: run the real
//! binary with each flag against real clients (nbdinfo, qemu-io) and check what a user would:
//! the captive command's environment and exit status, the data it wrote, the parent's exit
//! ending the server cleanly, the pid file, the sockets and ports listened on, the printed URI.

mod common;

use std::path::Path;
use std::process::{Command, Stdio};
use std::time::Duration;

use bufcache_nbd::NbdClient;
use common::*;

const TIMEOUT: Duration = Duration::from_secs(60);

fn serve(dir: &Path, args: &[&str]) -> Command {
    let mut command = Command::new(bufcache_bin());
    command.arg("serve").args(args).current_dir(dir);
    command
}

#[test]
fn run_gives_the_command_uri_socket_and_port_writes_back_its_data_and_exits_with_its_status() {
    // nbdkit's captive mode: the command sees $uri and $socket (a private unix socket when no
    // listener is named) or $port; its writes are on the disk when the server exits; the
    // server's exit status is the command's.
    let _timer = Timer::new(
        "run_gives_the_command_uri_socket_and_port_writes_back_its_data_and_exits_with_its_status",
    );
    if !have_tools("run_captive", &["qemu-io", "nbdinfo"]) {
        return;
    }
    let dir = temp_dir();
    let script = "test -S \"$socket\" || exit 90; \
        nbdinfo --size \"$uri\" > size.txt || exit 91; \
        qemu-io -f raw -c 'write -P 0x5a 4096 64k' \"$uri\" > /dev/null || exit 92; \
        exit 7";
    let output = run_timeout(
        serve(
            dir.path(),
            &[
                "--backend",
                "disk.img",
                "--create-size",
                "8M",
                "--run",
                script,
            ],
        ),
        TIMEOUT,
    );
    let text = output_text(&output);
    assert_eq!(output.status.code(), Some(7), "{text}");
    assert_eq!(
        std::fs::read_to_string(dir.path().join("size.txt"))
            .unwrap()
            .trim(),
        "8388608"
    );
    let disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert!(
        disk[4096..4096 + 65536].iter().all(|byte| *byte == 0x5a),
        "{text}"
    );
    assert!(disk[..4096].iter().all(|byte| *byte == 0));

    let port = free_tcp_port().to_string();
    let output = run_timeout(
        serve(
            dir.path(),
            &[
                "--backend",
                "memory:1M",
                "-b",
                "127.0.0.1",
                "-p",
                &port,
                "--run",
                "echo \"$port $uri\" > port.txt",
            ],
        ),
        TIMEOUT,
    );
    assert!(output.status.success(), "{}", output_text(&output));
    assert_eq!(
        std::fs::read_to_string(dir.path().join("port.txt"))
            .unwrap()
            .trim(),
        format!("{port} nbd://127.0.0.1:{port}/")
    );
}

#[test]
fn exit_with_parent_shuts_down_cleanly_when_the_parent_exits() {
    // The parent (a shell) starts the server in the background and exits when told; the
    // server must then shut down as on SIGTERM, writing back what a client wrote.
    let _timer = Timer::new("exit_with_parent_shuts_down_cleanly_when_the_parent_exits");
    let dir = temp_dir();
    let socket = dir.path().join("srv.sock");
    let script = format!(
        "'{bin}' serve --backend disk.img --create-size 4M --no-write-behind \
         --dirty-age-max 3600 --exit-with-parent -k '{socket}' -P srv.pid 2> srv.log & \
         while [ ! -e go ]; do sleep 0.02; done",
        bin = bufcache_bin(),
        socket = socket.display()
    );
    let mut parent = ChildGuard::spawn(
        Command::new("/bin/sh")
            .arg("-c")
            .arg(&script)
            .current_dir(dir.path())
            .stdout(Stdio::null()),
        "sh",
    );
    let pid_file = dir.path().join("srv.pid");
    wait_until("the server's pid file", TIMEOUT, || pid_file.exists());
    let pid: u32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    let data = random_bytes(128 << 10, 91);
    let client = NbdClient::connect(&format!("nbd+unix:///?socket={}", socket.display()))
        .expect("connecting through the -k socket");
    client.write(0, &data).unwrap();
    drop(client);
    std::fs::write(dir.path().join("go"), b"").unwrap();
    assert!(
        parent.wait(TIMEOUT).is_some(),
        "the parent shell did not exit"
    );
    let process = format!("/proc/{pid}");
    wait_until("the server to exit after its parent", TIMEOUT, || {
        !Path::new(&process).exists()
            || std::fs::read_to_string(format!("{process}/stat"))
                .map(|stat| stat.contains(") Z "))
                .unwrap_or(true)
    });
    let log = std::fs::read_to_string(dir.path().join("srv.log")).unwrap();
    assert!(log.contains("all data written back; bye"), "{log}");
    assert!(!pid_file.exists(), "the pid file outlived the server");
    let disk = std::fs::read(dir.path().join("disk.img")).unwrap();
    assert_same_bytes(&data, &disk[..data.len()], "disk.img");
}

#[test]
fn foreground_persistent_print_uri_and_version_are_accepted() {
    // -f and -t are what the server does anyway; --print-uri prints the URI a client uses on
    // stdout; `serve --version` prints the version; --help says how -e differs from qemu-nbd.
    let _timer = Timer::new("foreground_persistent_print_uri_and_version_are_accepted");
    let dir = temp_dir();
    let socket = dir.path().join("s.sock");
    let output = run_timeout(
        serve(
            dir.path(),
            &[
                "-f",
                "-t",
                "--print-uri",
                "--backend",
                "memory:1M",
                "-U",
                socket.to_str().unwrap(),
                "--run",
                "true",
            ],
        ),
        TIMEOUT,
    );
    assert!(output.status.success(), "{}", output_text(&output));
    assert_eq!(
        String::from_utf8_lossy(&output.stdout).trim(),
        format!("nbd+unix:///?socket={}", socket.display())
    );
    let version = run_ok(serve(dir.path(), &["--version"]), TIMEOUT);
    assert!(
        String::from_utf8_lossy(&version.stdout).contains(env!("CARGO_PKG_VERSION")),
        "{}",
        output_text(&version)
    );
    let help = run_ok(serve(dir.path(), &["--help"]), TIMEOUT);
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(help.contains("qemu-nbd's -e"), "{help}");
    assert!(
        help.contains("--pidfile") && help.contains("--socket"),
        "{help}"
    );
    assert!(help.contains("--shared"), "qemu-nbd's --shared: {help}");

    // No misleading "did you mean": --exit-with-parent exists now, and qemu-nbd's --fork is
    // refused with the reason rather than a suggestion of an unrelated flag.
    let fork = run_timeout(serve(dir.path(), &["--fork"]), TIMEOUT);
    let fork = String::from_utf8_lossy(&fork.stderr).into_owned();
    assert!(
        fork.contains("foreground") && !fork.contains("similar"),
        "{fork}"
    );
}

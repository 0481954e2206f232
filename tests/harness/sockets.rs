//! The TCP connections a process holds, found in `/proc`: how the nemesis tells the example's
//! own store sessions from everyone else's on a shared server (other tests, other helpers).

use std::{collections::HashSet, fs};

/// The local ports of the TCP sockets process `pid` has open (IPv4 and IPv6); empty when the
/// process is gone.
pub fn local_ports(pid: u32) -> HashSet<u16> {
    let inodes = socket_inodes(pid);
    let mut ports = HashSet::new();
    for table in ["tcp", "tcp6"] {
        let Ok(text) = fs::read_to_string(format!("/proc/{pid}/net/{table}")) else {
            continue;
        };
        // `sl local_address rem_address st tx:rx tr:when retrnsmt uid timeout inode ...`,
        // with addresses as `HEXADDR:HEXPORT`.
        for line in text.lines().skip(1) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (Some(local), Some(inode)) = (fields.get(1), fields.get(9)) else {
                continue;
            };
            let port = local
                .rsplit_once(':')
                .and_then(|(_, port)| u16::from_str_radix(port, 16).ok());
            if let (Some(port), true) = (port, inodes.contains(*inode)) {
                ports.insert(port);
            }
        }
    }
    ports
}

/// The inode numbers of the sockets among `pid`'s file descriptors (`socket:[INODE]`).
fn socket_inodes(pid: u32) -> HashSet<String> {
    let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
        return HashSet::new();
    };
    fds.filter_map(|fd| {
        let target = fs::read_link(fd.ok()?.path()).ok()?;
        let target = target.to_str()?;
        Some(
            target
                .strip_prefix("socket:[")?
                .strip_suffix(']')?
                .to_owned(),
        )
    })
    .collect()
}

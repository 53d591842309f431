//! A tiny blocking Redis client (RESP2), enough for fixtures and assertions.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::time::Duration;

use anyhow::{bail, Context, Result};

/// One Redis reply.
#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Status(String),
    Error(String),
    Integer(i64),
    Bulk(Option<String>),
    Array(Vec<Reply>),
}

impl Reply {
    /// The text of a status or bulk reply (`None` for anything else).
    pub fn text(&self) -> Option<&str> {
        match self {
            Reply::Status(text) | Reply::Bulk(Some(text)) => Some(text),
            _ => None,
        }
    }
}

/// Sends one command to the Redis on `127.0.0.1:port` over a fresh connection.
pub fn query(port: u16, args: &[&str]) -> Result<Reply> {
    let mut stream = TcpStream::connect(("127.0.0.1", port))
        .with_context(|| format!("connecting to Redis on port {port}"))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    stream.set_write_timeout(Some(Duration::from_secs(10)))?;
    stream.write_all(&packet(args))?;
    read(&mut BufReader::new(stream))
}

/// One command as RESP.
pub(crate) fn packet(args: &[&str]) -> Vec<u8> {
    let mut packet = format!("*{}\r\n", args.len()).into_bytes();
    for arg in args {
        packet.extend_from_slice(format!("${}\r\n", arg.len()).as_bytes());
        packet.extend_from_slice(arg.as_bytes());
        packet.extend_from_slice(b"\r\n");
    }
    packet
}

pub(crate) fn read(reader: &mut impl BufRead) -> Result<Reply> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        bail!("Redis closed the connection");
    }
    let line = line.trim_end_matches(['\r', '\n']);
    let (kind, rest) = line.split_at(line.len().min(1));
    Ok(match kind {
        "+" => Reply::Status(rest.to_owned()),
        "-" => Reply::Error(rest.to_owned()),
        ":" => Reply::Integer(rest.parse()?),
        "$" => {
            let len: i64 = rest.parse()?;
            if len < 0 {
                Reply::Bulk(None)
            } else {
                let mut bytes = vec![0; len as usize + 2];
                reader.read_exact(&mut bytes)?;
                bytes.truncate(len as usize);
                Reply::Bulk(Some(String::from_utf8_lossy(&bytes).into_owned()))
            }
        }
        "*" => {
            let len: i64 = rest.parse()?;
            let mut items = Vec::new();
            for _ in 0..len.max(0) {
                items.push(read(reader)?);
            }
            Reply::Array(items)
        }
        _ => bail!("not a RESP reply: {line:?}"),
    })
}

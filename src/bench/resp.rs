//! A minimal RESP2 client for the Redis peer: one TCP connection, commands
//! encoded into a buffer and sent with one write (pipelining), replies read
//! in order. RESP is the protocol the seed design spoke; the bench needs only
//! LPUSH, SET, BRPOP and PING, so a full Redis client crate would be dead
//! weight (and a slower client would flatter AGQ).

use std::{io, net::SocketAddr};

use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

/// One RESP2 reply.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Value {
    /// `+OK` and friends.
    Simple(String),
    /// `-ERR ...`.
    Error(String),
    /// `:n`.
    Int(i64),
    /// `$n` bulk string; `None` is the nil bulk (`$-1`).
    Bulk(Option<Vec<u8>>),
    /// `*n` array; `None` is the nil array (`*-1`, e.g. a BRPOP timeout).
    Array(Option<Vec<Value>>),
}

/// A connection to a Redis server.
pub struct Conn {
    io: BufReader<TcpStream>,
    out: Vec<u8>,
    queued: usize,
    line: Vec<u8>,
}

fn bad(msg: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, msg.into())
}

impl Conn {
    /// Connects to `addr` with TCP_NODELAY.
    ///
    /// Errors: the connect error.
    pub async fn connect(addr: SocketAddr) -> io::Result<Conn> {
        let s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        Ok(Conn {
            io: BufReader::with_capacity(64 * 1024, s),
            out: Vec::with_capacity(64 * 1024),
            queued: 0,
            line: Vec::with_capacity(64),
        })
    }

    /// Queues one command (an array of bulk strings) without sending it.
    pub fn queue(&mut self, args: &[&[u8]]) {
        use std::io::Write;
        let _ = write!(self.out, "*{}\r\n", args.len());
        for a in args {
            let _ = write!(self.out, "${}\r\n", a.len());
            self.out.extend_from_slice(a);
            self.out.extend_from_slice(b"\r\n");
        }
        self.queued += 1;
    }

    /// Sends the queued commands in one write and reads their replies, in
    /// order. A Redis error reply is returned as [`Value::Error`], not as `Err`.
    ///
    /// Errors: I/O errors and malformed replies.
    pub async fn flush(&mut self) -> io::Result<Vec<Value>> {
        self.io.get_mut().write_all(&self.out).await?;
        self.out.clear();
        let n = std::mem::take(&mut self.queued);
        let mut replies = Vec::with_capacity(n);
        for _ in 0..n {
            replies.push(self.read().await?);
        }
        Ok(replies)
    }

    /// Sends one command and returns its reply.
    ///
    /// Errors: I/O errors and malformed replies.
    pub async fn cmd(&mut self, args: &[&[u8]]) -> io::Result<Value> {
        self.queue(args);
        let mut r = self.flush().await?;
        r.pop().ok_or_else(|| bad("no reply"))
    }

    async fn read_line(&mut self) -> io::Result<()> {
        self.line.clear();
        let n = self.io.read_until(b'\n', &mut self.line).await?;
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "redis closed the connection",
            ));
        }
        if !self.line.ends_with(b"\r\n") {
            return Err(bad("reply line without CRLF"));
        }
        self.line.truncate(self.line.len() - 2);
        Ok(())
    }

    fn line_int(&self) -> io::Result<i64> {
        std::str::from_utf8(&self.line[1..])
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| bad("bad integer in reply"))
    }

    /// Reads one reply (arrays iteratively, one level of nesting is all
    /// BRPOP needs, but any depth works).
    async fn read(&mut self) -> io::Result<Value> {
        // Stack of (array being filled, elements still expected).
        let mut stack: Vec<(Vec<Value>, usize)> = Vec::new();
        loop {
            self.read_line().await?;
            let kind = *self.line.first().ok_or_else(|| bad("empty reply line"))?;
            let mut value = match kind {
                b'+' => Value::Simple(String::from_utf8_lossy(&self.line[1..]).into_owned()),
                b'-' => Value::Error(String::from_utf8_lossy(&self.line[1..]).into_owned()),
                b':' => Value::Int(self.line_int()?),
                b'$' => {
                    let len = self.line_int()?;
                    if len < 0 {
                        Value::Bulk(None)
                    } else {
                        let mut buf = vec![0u8; len as usize + 2];
                        self.io.read_exact(&mut buf).await?;
                        buf.truncate(len as usize);
                        Value::Bulk(Some(buf))
                    }
                }
                b'*' => {
                    let len = self.line_int()?;
                    if len < 0 {
                        Value::Array(None)
                    } else if len == 0 {
                        Value::Array(Some(Vec::new()))
                    } else {
                        stack.push((Vec::with_capacity(len as usize), len as usize));
                        continue;
                    }
                }
                other => return Err(bad(format!("unknown reply type {:?}", other as char))),
            };
            loop {
                let Some((items, want)) = stack.last_mut() else {
                    return Ok(value);
                };
                items.push(value);
                if items.len() < *want {
                    break;
                }
                let (items, _) = stack.pop().expect("non-empty stack");
                value = Value::Array(Some(items));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replies parse from a canned byte stream served on a loopback socket.
    #[tokio::test]
    async fn parses_replies() {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let server = tokio::spawn(async move {
            let (mut s, _) = l.accept().await.unwrap();
            let mut buf = vec![0u8; 4096];
            let _ = s.read(&mut buf).await.unwrap();
            s.write_all(
                b"+OK\r\n:7\r\n$-1\r\n*2\r\n$3\r\nkey\r\n$5\r\nva\r\nl\r\n*-1\r\n-ERR x\r\n",
            )
            .await
            .unwrap();
        });
        let mut c = Conn::connect(addr).await.unwrap();
        for _ in 0..6 {
            c.queue(&[b"PING"]);
        }
        let r = c.flush().await.unwrap();
        server.await.unwrap();
        assert_eq!(
            r,
            vec![
                Value::Simple("OK".into()),
                Value::Int(7),
                Value::Bulk(None),
                Value::Array(Some(vec![
                    Value::Bulk(Some(b"key".to_vec())),
                    Value::Bulk(Some(b"va\r\nl".to_vec()))
                ])),
                Value::Array(None),
                Value::Error("ERR x".into()),
            ]
        );
    }
}

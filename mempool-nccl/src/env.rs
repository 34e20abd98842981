//! The launcher's environment: rank, world size, local rank and NCCL's bootstrap address, as
//! torchrun, srun or mpirun set them ([`Communicator::from_env`](crate::Communicator::from_env)
//! reads it).

use crate::error::{Error, Result};

/// Rank, world size, local rank and bootstrap address from a launcher's environment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchEnv {
    /// This process's rank.
    pub rank: usize,
    /// Number of ranks.
    pub world_size: usize,
    /// This process's rank on its node (its device).
    pub local_rank: usize,
    /// `NCCL_COMM_ID` to set before the first NCCL call (None: it is set already).
    pub comm_id_to_set: Option<String>,
}

const RANK_VARS: [&str; 4] = ["RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"];
const SIZE_VARS: [&str; 4] = ["WORLD_SIZE", "SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"];
const LOCAL_VARS: [&str; 3] = ["LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK"];

impl LaunchEnv {
    /// Reads the variables through `get` (the process environment in
    /// [`Communicator::from_env`](crate::Communicator::from_env)).
    pub fn read(get: impl Fn(&str) -> Option<String>) -> Result<LaunchEnv> {
        let num = |vars: &[&'static str], what: &str| -> Result<Option<usize>> {
            let mut found: Option<(usize, &'static str)> = None;
            for &v in vars {
                if let Some(s) = get(v) {
                    let n: usize =
                        s.trim().parse().map_err(|_| Error::Environment(format!("{v}={s:?} is not a {what}")))?;
                    if let Some((m, w)) = found {
                        if m != n {
                            return Err(Error::Environment(format!("{w}={m} and {v}={n} disagree on the {what}")));
                        }
                    } else {
                        found = Some((n, v));
                    }
                }
            }
            Ok(found.map(|(n, _)| n))
        };
        let rank = num(&RANK_VARS, "rank")?
            .ok_or_else(|| Error::Environment(format!("no rank: set one of {}", RANK_VARS.join(", "))))?;
        let world_size = num(&SIZE_VARS, "world size")?
            .ok_or_else(|| Error::Environment(format!("no world size: set one of {}", SIZE_VARS.join(", "))))?;
        if rank >= world_size {
            return Err(Error::InvalidRank { rank, world_size });
        }
        let local_rank = num(&LOCAL_VARS, "local rank")?.unwrap_or(rank);
        let comm_id_to_set = match get("NCCL_COMM_ID") {
            Some(_) => None,
            None => {
                let addr = get("MASTER_ADDR");
                let port = get("MASTER_PORT");
                match (addr, port) {
                    (Some(a), Some(p)) => {
                        let port: u16 = p
                            .trim()
                            .parse()
                            .map_err(|_| Error::Environment(format!("MASTER_PORT={p:?} is not a port")))?;
                        // torchrun's own store listens on MASTER_PORT; NCCL's root takes the next one.
                        let port = if get("TORCHELASTIC_RUN_ID").is_some() { port.wrapping_add(1) } else { port };
                        Some(format!("{a}:{port}"))
                    }
                    _ => {
                        return Err(Error::Environment(
                            "no bootstrap address: set NCCL_COMM_ID=<host>:<port>, or MASTER_ADDR and MASTER_PORT"
                                .into(),
                        ))
                    }
                }
            }
        };
        Ok(LaunchEnv { rank, world_size, local_rank, comm_id_to_set })
    }

    /// Reads the process environment.
    pub fn from_process() -> Result<LaunchEnv> {
        LaunchEnv::read(|k| std::env::var(k).ok())
    }

    /// Sets `NCCL_COMM_ID` where it is not set yet, so that NCCL's own bootstrap finds rank 0.
    /// Called before this process's first NCCL call, so no NCCL thread reads the environment
    /// meanwhile.
    pub(crate) fn export_comm_id(&self) {
        if let Some(comm_id) = &self.comm_id_to_set {
            std::env::set_var("NCCL_COMM_ID", comm_id);
        }
    }
}

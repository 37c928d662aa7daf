//! Faults at run time: the lines appended to the control file (`xid`, `ecc`, `action`,
//! `lost`, `found`, `events`, `mig`; see the crate's documentation), applied to the state
//! before each exported call answers (`with_state`), so every 2 ms while a caller waits for
//! events.

use crate::abi::{EVENT_DBE, EVENT_MIG, EVENT_RECOVERY_ACTION, EVENT_XID};
use crate::state::State;

impl State {
    /// Applies the complete lines appended to the control file since the last look.
    pub(crate) fn poll_control(&mut self) {
        let Some(path) = &self.control else {
            return;
        };
        let Ok(text) = std::fs::read_to_string(path) else {
            return;
        };
        let Some(new) = text.get(self.control_offset..) else {
            // Truncated or rewritten: start over from its end.
            self.control_offset = text.len();
            return;
        };
        let Some(end) = new.rfind('\n') else {
            return;
        };
        let lines: Vec<String> = new[..end].lines().map(str::to_owned).collect();
        self.control_offset = self.control_offset.saturating_add(end + 1);
        for line in lines {
            if let Err(err) = self.apply(&line) {
                eprintln!("fake-nvml: control line {line:?}: {err}");
            }
        }
    }

    pub(crate) fn apply(&mut self, line: &str) -> Result<(), String> {
        let words: Vec<&str> = line.split_whitespace().collect();
        let Some((&verb, args)) = words.split_first() else {
            return Ok(());
        };
        if verb == "mig" {
            let gpu = args
                .first()
                .and_then(|w| self.find(w))
                .ok_or("no such GPU")?;
            let layout = args.get(1).ok_or("mig <gpu> <layout>|off")?;
            let g = &mut self.gpus[gpu];
            if g.config.mig.is_none() {
                return Err("this GPU has no MIG".into());
            }
            if *layout == "off" {
                g.mig_on = false;
                g.migs.clear();
            } else {
                g.migs = g
                    .config
                    .mig_layouts
                    .get(*layout)
                    .ok_or_else(|| format!("no MIG layout {layout:?}"))?
                    .iter()
                    .cloned()
                    .map(Some)
                    .collect();
                g.mig_on = true;
            }
            // The new layout replaces every instance, created ones too.
            g.drop_created();
            self.send(gpu, EVENT_MIG, 0);
            return Ok(());
        }
        if verb == "events" {
            self.events_broken = match args.first() {
                Some(&"broken") => true,
                Some(&"ok") => false,
                _ => return Err("events broken|ok".into()),
            };
            return Ok(());
        }
        let gpu = args
            .first()
            .and_then(|w| self.find(w))
            .ok_or("no such GPU")?;
        let number = |i: usize| -> Result<u64, String> {
            args.get(i)
                .ok_or_else(|| format!("argument {i} missing"))?
                .parse::<u64>()
                .map_err(|e| e.to_string())
        };
        match verb {
            "xid" => {
                let code = number(1)?;
                // `gi=<id>` and `ci=<id>` anywhere after the code; the rest is positional.
                let (mut gi, mut ci) = (u32::MAX, u32::MAX);
                let mut positional = 0usize;
                for (i, word) in args.iter().enumerate().skip(2) {
                    let id = |v: &str| v.parse::<u32>().map_err(|e| format!("{word}: {e}"));
                    if let Some(v) = word.strip_prefix("gi=") {
                        gi = id(v)?;
                    } else if let Some(v) = word.strip_prefix("ci=") {
                        ci = id(v)?;
                    } else if positional == 0 {
                        positional = i;
                    } else {
                        return Err(format!("unexpected {word:?}"));
                    }
                }
                if positional != 0 {
                    let action = u32::try_from(number(positional)?).map_err(|e| e.to_string())?;
                    self.gpus[gpu].recovery_action = action;
                }
                self.send_to_instance(gpu, EVENT_XID, code, (gi, ci));
            }
            "ecc" => {
                if args.len() > 1 {
                    let action = u32::try_from(number(1)?).map_err(|e| e.to_string())?;
                    self.gpus[gpu].recovery_action = action;
                }
                self.send(gpu, EVENT_DBE, 0);
            }
            "action" => {
                self.gpus[gpu].recovery_action =
                    u32::try_from(number(1)?).map_err(|e| e.to_string())?;
                if self.config.recovery_action {
                    self.send(
                        gpu,
                        EVENT_RECOVERY_ACTION,
                        u64::from(self.gpus[gpu].recovery_action),
                    );
                }
            }
            "lost" => {
                self.gpus[gpu].lost = true;
                let sets: Vec<usize> = self.gpus[gpu].registered.iter().map(|r| r.0).collect();
                for set in sets {
                    if let Some(Some(set)) = self.sets.get_mut(set) {
                        set.lost = true;
                    }
                }
            }
            "found" => self.gpus[gpu].lost = false,
            other => return Err(format!("unknown verb {other:?}")),
        }
        Ok(())
    }
}

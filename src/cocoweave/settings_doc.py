"""docs/settings.md, generated from the table of COCOWEAVE_* settings (`cocoweave.settings`) and the launchers'
variables (`cocoweave.rankenv`): `python -m cocoweave.settings_doc > docs/settings.md`."""

from __future__ import annotations

from .rankenv import LAUNCHERS, RENDEZVOUS
from .settings import SETTINGS


def markdown() -> str:
    """docs/settings.md: the settings table, then the launchers' variables that RankEnv reads."""

    def row(*cells: str) -> str:
        return "| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |"

    lines = ["# Settings", "",
             "The environment variables cocoweave reads. Generated from `src/cocoweave/settings.py` (the COCOWEAVE_* "
             "table) and `src/cocoweave/rankenv.py` (the launchers) by `python -m cocoweave.settings_doc "
             "> docs/settings.md`; tests/test_settings.py checks that this file is current.", "",
             "## COCOWEAVE_* settings", "",
             "Unset or empty means the default. A malformed value stops the run with one sentence naming the "
             "variable.", "",
             row("Variable", "Type", "Default", "Meaning", "Read by"), row(*["---"] * 5)]
    for s in SETTINGS:
        lines.append(row(f"`{s.name}`", s.type_doc(), s.default_doc(), s.meaning, f"`{s.read_by}`"))
    lines += ["", "## Launchers", "",
              "`cocoweave.rankenv.RankEnv` reads which rank this process is from its launcher's variables; supporting "
              "another launcher is one more row of `LAUNCHERS`. Where several launchers' variables are set, a "
              "launcher that marks its own workers (torchrun: TORCHELASTIC_RUN_ID) runs inside the other (torchrun "
              "under srun) and wins; otherwise they must agree, or the run stops with one sentence naming both. "
              "Once torch.distributed is initialised, its rank and world size are the ones used.", "",
              row("Launcher", "Rank", "World size", "Local rank", "Local world size", "Node", "Marks its workers"),
              row(*["---"] * 7)]
    for launcher in LAUNCHERS:
        cells = [f"`{v}`" if v else "" for v in (launcher.rank, launcher.world_size, launcher.local_rank,
                                                  launcher.local_world_size, launcher.node_rank, launcher.marker)]
        if launcher.tasks_per_node:  # the local world size from the per-node list where the variable is unset
            cells[3] += f", else `{launcher.tasks_per_node}` at the node's index"
        lines.append(row(launcher.name, *cells))
    lines += ["", "Joining a process group (`cocoweave.launch.init_from_env`) also needs "
              + ", ".join(f"`{v}`" for v in RENDEZVOUS) + " (torchrun sets them; under srun, export them). "
              "A rank's CPU threads come from `OMP_NUM_THREADS` when set.", "",
              "## Other variables", "",
              "Read as their owners define them: `TRITON_INTERPRET` (Triton's interpreter: kernels run on the CPU), "
              "`XDG_CACHE_HOME` (the code cache's default parent folder), `GLOO_SOCKET_IFNAME` (Gloo's interface; "
              "set to the loopback interface when a whole world meets at a loopback address).", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(), end="")

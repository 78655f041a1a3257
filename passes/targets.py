"""targets: the inner compilers a plan is made for, one object each. The options name them by a
string ("eager", "inductor"); from there on the backend hands the passes a Target, and each pass
asks it what it needs instead of comparing names.

What differs between the two (Note [Min-cut under Inductor] in passes/partition.py):
- Eager runs every op of the partitioned graphs as a kernel of its own. What a policy leaves open
  is saved (AOTAutograd's default partition); ops are priced as they run; a plan's peak is the
  walk of its graphs, op by op; a budget judges its candidates by walking the joint graph.
- Inductor fuses pointwise ops into their consumers. What a policy leaves open goes to torch's
  min-cut partitioner, which recomputes cheap fusible ops as Inductor alone does; ops are priced
  fused; a plan's peak is read from Inductor's own schedule of its graphs (passes/inductor_memory.py);
  a budget plans its candidates to judge them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from passes._compat import default_partition, min_cut_partition


@dataclass(frozen=True)
class Target:
    """An inner compiler, as the passes see it."""

    name: str
    """As the options spell it: "eager" or "inductor"."""
    fuses: bool
    """Pointwise ops run inside their consumers' kernels: priced fused, partitioned by min-cut,
    peaks from Inductor's schedule, a budget searched by planning its candidates."""
    own_partition: str
    """What the inner compiler does without us, as a fallback's warning names it."""

    def partition(self, joint: torch.fx.GraphModule, joint_inputs: object, **kwargs: object
                  ) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
        """Torch's partition of a joint graph for this inner compiler, honouring the recompute tags
        on its nodes: min-cut's under Inductor, AOTAutograd's default under eager."""
        split = min_cut_partition if self.fuses else default_partition
        return split(joint, joint_inputs, **kwargs)


EAGER = Target("eager", fuses=False, own_partition="AOTAutograd's default partition")
INDUCTOR = Target("inductor", fuses=True, own_partition="Inductor's own partition")
TARGETS = {target.name: target for target in (EAGER, INDUCTOR)}
"""Every inner compiler by the name the options give it."""

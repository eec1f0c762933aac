"""`kvbridge chaos`: a real PD deployment on this machine, played with faults, checked for lost work.

`faults` names what can be injected (transfer faults go through the library's one injector,
`kvbridge.transport.faults`, which a decode server turns on with `fault_injection` in its connector config),
`deployment` starts and restarts the vLLM servers and the proxy, `runner` plays the requests and builds the `Report`.
"""

from kvbridge_tools.chaos.faults import FAULTS, parse_faults
from kvbridge_tools.chaos.report import Outcome, Report

__all__ = ["FAULTS", "Outcome", "Report", "parse_faults"]

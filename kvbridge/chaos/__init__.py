"""`kvbridge chaos`: a real PD deployment on this machine, played with faults, checked for lost work.

`faults` names what can be injected, `inject` wraps a decode's transport to fail or hold transfers
(only when a server is started with `fault_injection` in its connector config), `deployment` starts
and restarts the vLLM servers and the proxy, `runner` plays the requests and builds the `Report`.
"""

from kvbridge.chaos.faults import FAULTS, parse_faults
from kvbridge.chaos.report import Outcome, Report

__all__ = ["FAULTS", "Outcome", "Report", "parse_faults"]

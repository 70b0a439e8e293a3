"""Network offload: ports and flow rules (match -> actions) on the DPU's switch ports.

`model` holds the domain types, `backend` the small interface a datapath implements
(`tc_backend`: Linux tc flower through pyroute2, offloaded to the embedded switch on
BlueField in switchdev mode, software datapath elsewhere).
"""

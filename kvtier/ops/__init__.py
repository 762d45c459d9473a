"""The operator's surface: the declared metrics, the SLO guard, the control socket and its client.
"""

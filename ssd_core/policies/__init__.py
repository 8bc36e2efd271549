"""Strategies: small interchangeable objects that answer "which sublayers to skip now".

The decode loop never branches on which one it runs. `registry` names them all and builds one from a
calibration; each strategy lives in its own module.
"""

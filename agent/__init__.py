"""The node agent: registers its node with the portal, reports the node's devices, starts and
supervises elastic workers on the portal's command, and reports what they do. It imports
`elastic` for the wire messages and never Django or the portal."""

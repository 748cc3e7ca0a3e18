//! EgressGatewayPolicy and EgressNode custom resources.
